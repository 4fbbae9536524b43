"""The doctor's probe (areal_hpc/launch/doctor_probe.py) under mpirun instead of a Slurm job, for tests/test_doctor.py:
each rank takes the place Slurm would give it (SLURM_PROCID, SLURM_LOCALID: one task per node) and runs the
probe's main, which writes OUT_DIR/rank<r>.json.

    mpirun -n 5 python tests/support/mpi/probe_world.py OUT_DIR DEVICE STARTS SOURCES INTERFACE
"""

import os
import sys
from pathlib import Path

rank = os.environ["OMPI_COMM_WORLD_RANK"]
os.environ["SLURM_PROCID"] = rank
os.environ["SLURM_LOCALID"] = rank  # only rank 0 checks its node's package versions (a child process each)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from areal_hpc.launch.doctor_probe import cli  # noqa: E402 - after the stand-in Slurm variables

cli(sys.argv[1:])
