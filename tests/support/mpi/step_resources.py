"""Stand-in entry of a Slurm job, for tests/test_slurm.py: rank 0 writes to OUT_FILE the node of every rank
and what `scontrol show` says of each component and its part of the step (job ids of components are
consecutive).

    python tests/support/mpi/step_resources.py OUT_FILE   (each rank of the job's srun step)
"""

import json
import os
import subprocess
import sys

from mpi4py import MPI


def show(*args: str) -> str:
    return subprocess.run(["scontrol", "show", *args], capture_output=True, text=True).stdout


world = MPI.COMM_WORLD
nodes = world.gather(os.environ["SLURMD_NODENAME"])
if world.Get_rank() == 0:
    first = int(os.environ["SLURM_JOB_ID"])
    components = range(int(os.environ.get("SLURM_HET_SIZE", "1")))
    steps = [show("step", f"{first + k}.0") for k in components]
    with open(sys.argv[1], "w") as f:
        json.dump({"nodes": nodes, "steps": steps, "jobs": [show("job", str(first + k)) for k in components]}, f)
world.Barrier()
