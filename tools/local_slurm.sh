#!/usr/bin/env bash
# A real Slurm cluster on this machine, for the `slurm`-marked tests and for trying `areal-hpc submit`:
# Debian's slurmctld, several `slurmd -D -N nodeX` fake nodes on loopback, munge, and fake GPUs
# (4 per node, gres backed by character devices). No systemd, no cgroups, no accounting.
# Partitions over the same nodes: `debug` (the default, never preempted), and `low` and `high` with
# Slurm's own preemption by partition priority: a job in `high` takes the nodes of jobs in `low`, which
# get SIGTERM, GraceTime seconds (see slurm.conf.in), SIGKILL, and are requeued.
# Each fake node has a node-local disk at $AREAL_SLURM_ROOT/local: a tmpfs mounted in that slurmd's own
# mount namespace, so what a job writes there stays on its node, as on a cluster's /local or /tmp
# (elsewhere the nodes share this machine's filesystem, as they would a cluster's shared one).
#
#   tools/local_slurm.sh start     # idempotent (a changed slurm.conf.in is applied with reconfigure)
#   tools/local_slurm.sh status
#   tools/local_slurm.sh stop      # ends only the processes this script started (recorded pids)
#   tools/local_slurm.sh env       # prints `export SLURM_CONF=...` (for eval)
#
# Settings (environment): AREAL_SLURM_ROOT (default: <repo>/.slurm, gitignored), AREAL_SLURM_NODES
# (default 4), AREAL_SLURM_PORT (slurmctld port, default 16817; slurmd ports follow it).
# Needs root (slurmd runs jobs as any user) and the Debian packages of tools/setup.sh.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=${AREAL_SLURM_ROOT:-$repo/.slurm}
nodes=${AREAL_SLURM_NODES:-4}
port=${AREAL_SLURM_PORT:-16817}
conf=$root/etc/slurm.conf
pids=$root/run/pids   # "name pid" per line: only these are ever signalled
export SLURM_CONF=$conf

say() { printf '[local_slurm] %s\n' "$*"; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
recorded() { [ -f "$pids" ] && awk -v n="$1" '$1 == n { print $2 }' "$pids" | tail -n 1; }

running() {  # every recorded daemon alive?
  [ -f "$pids" ] || return 1
  local name pid
  while read -r name pid; do
    [ "$name" = munged ] && continue
    alive "$pid" || return 1
  done <"$pids"
  return 0
}

usage() {
  cat <<EOF
Slurm test cluster: $nodes nodes (node1..node$nodes, 8 CPUs and 4 fake GPUs each), partitions 'debug'
(default), 'low' (preemptible) and 'high' (preempts 'low'); node-local disk: $root/local.
Use it with:
  export SLURM_CONF=$conf
  sinfo; srun -N2 hostname; areal-hpc submit configs/tiny-cpu.yaml --nodes 3
Stop it with: tools/local_slurm.sh stop
EOF
}

fill() {  # fill TEMPLATE > OUT
  local node_ports="$((port + 10))-$((port + 10 + nodes - 1))"
  sed -e "s|@ROOT@|$root|g" -e "s|@HOST@|$(hostname)|g" -e "s|@NODES@|$nodes|g" \
    -e "s|@CTLD_PORT@|$port|g" -e "s|@SLURMD_PORT@|$((port + 1))|g" -e "s|@NODE_PORTS@|$node_ports|g" "$1" >"$2"
}

start_munge() {
  if munge -n >/dev/null 2>&1; then
    return 0  # a munged is already serving; it is not ours, leave it be
  fi
  mkdir -p /run/munge
  chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged  # daemonizes, writes its pid file
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
  echo "munged $(cat /run/munge/munged.pid)" >>"$pids"
}

start() {
  if running; then
    # a changed template (new partitions, say) reaches the running cluster without a restart
    fill "$repo/tools/local_slurm/slurm.conf.in" "$conf.new"
    if cmp -s "$conf.new" "$conf"; then
      rm -f "$conf.new"
      say "already running ($conf)"
    else
      mv "$conf.new" "$conf"
      scontrol reconfigure
      say "already running ($conf); its slurm.conf changed and is applied (scontrol reconfigure)"
    fi
    usage
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || { echo "local_slurm.sh: needs root (slurmd)" >&2; exit 1; }
  for bin in slurmctld slurmd munged sinfo; do
    command -v "$bin" >/dev/null || [ -x "/usr/sbin/$bin" ] || {
      echo "local_slurm.sh: $bin is missing; run tools/setup.sh" >&2
      exit 1
    }
  done
  [ -f "$pids" ] && stop_daemons quiet  # a half-started cluster from before
  mkdir -p "$root"/{etc,state,log,run}
  : >"$pids"
  fill "$repo/tools/local_slurm/slurm.conf.in" "$conf"
  fill "$repo/tools/local_slurm/gres.conf.in" "$root/etc/gres.conf"
  mkdir -p "$root/local"
  for i in $(seq "$nodes"); do
    mkdir -p "$root/spool/slurmd.node$i" "$root/tmp/node$i" "$root/dev/node$i"
    for g in 0 1 2 3; do
      [ -c "$root/dev/node$i/nvidia$g" ] || mknod -m 666 "$root/dev/node$i/nvidia$g" c 1 3
    done
    echo "NodeName=node$i Name=gpu File=$root/dev/node$i/nvidia[0-3]" >>"$root/etc/gres.conf"
  done
  start_munge
  # setsid: the daemons must not die with this shell or receive its terminal's signals
  setsid nohup /usr/sbin/slurmctld -D -i -f "$conf" >>"$root/log/slurmctld.out" 2>&1 </dev/null &
  echo "slurmctld $!" >>"$pids"
  for i in $(seq "$nodes"); do
    # unshare and sh exec into slurmd: the recorded pid is slurmd's. Its jobs inherit its mount namespace.
    setsid nohup unshare --mount --propagation slave sh -c \
      'mount -t tmpfs -o size=64m "node$1-local" "$2/local" && exec /usr/sbin/slurmd -D -N "node$1" -f "$3"' \
      sh "$i" "$root" "$conf" >>"$root/log/slurmd.node$i.out" 2>&1 </dev/null &
    echo "slurmd.node$i $!" >>"$pids"
  done
  local t0=$SECONDS
  # sinfo -N lists a node once per partition: count the distinct idle nodes
  until [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | grep -c ' idle$')" -ge "$nodes" ]; do
    if [ $((SECONDS - t0)) -gt 60 ]; then
      echo "local_slurm.sh: nodes not idle after 60 s; logs in $root/log" >&2
      sinfo -N 2>&1 >&2 || true
      exit 1
    fi
    sleep 0.2
  done
  say "up: $nodes nodes idle after $((SECONDS - t0)) s"
  usage
}

# Step daemons (slurmstepd daemonizes away from slurmd), batch scripts, srun and ranks of this cluster's
# jobs: the processes that inherited this cluster's SLURM_CONF and are a step daemon or run inside a
# job (SLURM_JOB_ID) -- not a shell that merely exported SLURM_CONF. A step daemon left by a failed
# PMIx launch may ignore SIGTERM; stop_daemons then SIGKILLs it by pid.
job_processes() {
  local p env
  for p in /proc/[0-9]*; do
    env=$({ tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
    grep -qx "SLURM_CONF=$conf" <<<"$env" || continue
    if [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || grep -q "^SLURM_JOB_ID=" <<<"$env"; then
      echo "${p#/proc/}"
    fi
  done
}

stop_daemons() {
  [ -f "$pids" ] || { [ "${1:-}" = quiet ] || say "not running (no $pids)"; return 0; }
  if alive "$(recorded slurmctld)"; then
    scancel --full --quiet -u "$(id -un)" 2>/dev/null || true  # end our jobs before their nodes go
  fi
  local stepds list pid
  stepds=$(job_processes)
  list=$(awk '{ print $2 }' "$pids")
  # shellcheck disable=SC2086
  kill -TERM $list $stepds 2>/dev/null || true
  for _ in $(seq 50); do
    local left=""
    for pid in $list $stepds; do alive "$pid" && left="$left $pid"; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  for pid in $list $stepds; do
    if alive "$pid"; then
      say "SIGKILL $pid (did not end on SIGTERM)"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$pids"
  [ "${1:-}" = quiet ] || say "stopped"
}

status() {
  if running; then
    say "running: SLURM_CONF=$conf"
    sinfo -N -o "%N %T %G %C" || true
    squeue || true
  else
    say "not running"
    return 1
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop_daemons ;;
  status) status ;;
  env) echo "export SLURM_CONF=$conf" ;;
  *)
    echo "usage: $0 start|stop|status|env" >&2
    exit 2
    ;;
esac
