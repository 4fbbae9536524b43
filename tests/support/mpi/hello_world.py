"""Stand-in entry of a Slurm job, for tests/test_slurm.py: every rank writes OUT_DIR/rank<N>.json with its
rank, the world size, the sum of all ranks (one allreduce across the job) and what Slurm set for it.

    python tests/support/mpi/hello_world.py OUT_DIR   (each rank of the job's srun step)
"""

import json
import os
import sys

from mpi4py import MPI

world = MPI.COMM_WORLD
total = world.allreduce(world.Get_rank())
keys = ("SLURM_PROCID", "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")
info = {"rank": world.Get_rank(), "size": world.Get_size(), "sum": total, **{k: os.environ.get(k) for k in keys}}
with open(os.path.join(sys.argv[1], f"rank{world.Get_rank()}.json"), "w") as f:
    json.dump(info, f)
