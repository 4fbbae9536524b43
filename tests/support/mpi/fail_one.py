"""Stand-in entry of a Slurm job, for tests/test_slurm.py: the last rank exits with 3 at once, the others
sleep 600 s unless the step ends them.
"""

import sys
import time

from mpi4py import MPI

world = MPI.COMM_WORLD
if world.Get_rank() == world.Get_size() - 1:
    sys.exit(3)
time.sleep(600)
