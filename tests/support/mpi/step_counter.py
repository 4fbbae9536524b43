"""Stand-in entry of a Slurm job for tests/test_slurm.py, in place of the controller's checkpoint and resume:
rank 0 counts steps (one every DELAY seconds, up to TOTAL), appends each to RUN_DIR/metrics.jsonl with the
job's attempt and checkpoints the count after it; on SIGUSR2 it exits with the "requeue me" code
EXIT_STOPPED, the others follow its decision. A requeued attempt goes on from the checkpointed count.

    python tests/support/mpi/step_counter.py RUN_DIR TOTAL DELAY   (each rank of the job's srun step)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

stop = False


def on_stop(signum, frame):
    global stop
    stop = True


# Rank 0 takes the signal before MPI starts (seconds under load), which leaves a signal that comes first
# only the interpreter's start to kill the program in.
if os.environ.get("SLURM_PROCID", "0") == "0":
    signal.signal(signal.SIGUSR2, on_stop)

from mpi4py import MPI  # noqa: E402

from areal_hpc.exit_codes import EXIT_STOPPED  # noqa: E402

run_dir, total, delay = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
world = MPI.COMM_WORLD
ckpt = run_dir / "counter.json"
step = world.bcast(json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0)
attempt = int(os.environ.get("SLURM_RESTART_COUNT", 0))
while step < total:
    if world.bcast(stop):
        sys.exit(EXIT_STOPPED if world.Get_rank() == 0 else 0)
    time.sleep(delay)
    step += 1
    world.allreduce(1)
    if world.Get_rank() == 0:
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "attempt": attempt}) + "\n")
        ckpt.write_text(json.dumps({"step": step}))
