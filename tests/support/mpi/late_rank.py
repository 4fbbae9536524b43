"""A rank that comes late, for tests/test_protocol.py: rank 1 stays away LATE_S before each of two `arrive`s.
Rank 0 gives up on the first after 0.5 s (`arrive` returns False), then waits the second out asleep: its CPU
time in that wait is a small part of the wait (a blocking MPI_Barrier polls a core the whole time). Prints
`OK <wait s> <CPU s>` on rank 0.

    mpirun -n 2 python tests/support/mpi/late_rank.py
"""

import sys
import time

from mpi4py import MPI

from areal_hpc.protocol import arrive

LATE_S = 2.0


def abort(*exc):  # a failed check ends both ranks at once, not rank 1 waiting for ever
    sys.__excepthook__(*exc)
    MPI.COMM_WORLD.Abort(1)


sys.excepthook = abort
comm = MPI.COMM_WORLD
comm.Barrier()  # both started: the times below count from here
if comm.rank == 1:
    for _ in range(2):
        time.sleep(LATE_S)
        assert arrive(comm)
else:
    t0 = time.monotonic()
    assert arrive(comm, timeout_s=0.5) is False
    assert time.monotonic() - t0 < LATE_S
    wall, cpu = time.monotonic(), time.process_time()
    assert arrive(comm)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert wall > LATE_S, wall  # both of rank 1's arrivals are behind it
    assert cpu < 0.2 * wall, (wall, cpu)
    print(f"OK {wall:.2f} {cpu:.2f}")
