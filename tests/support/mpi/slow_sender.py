"""A sender that leaves MPI after sending, for tests/test_protocol.py: rank 1 sends a Trajectory whose
arrays are large enough that MPI moves them only while rank 1 is inside MPI (over TCP), then a Stop,
then waits outside MPI until rank 0 writes DIR/go. Rank 0 polls meanwhile: every poll returns at once
and returns nothing (the Stop has arrived whole, but not the Trajectory sent before it); once rank 1 is
back in MPI (its flush) both arrive, in order, intact. Prints `OK` on rank 0.

    mpirun -n 2 python tests/support/mpi/slow_sender.py DIR
"""

import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from areal_hpc.protocol import Mailbox, Stop, Trajectory

N = 4_000_000  # int32 tokens: 16 MB, far past the eager limit of any transport
go = Path(sys.argv[1]) / "go"
comm = MPI.COMM_WORLD
box = Mailbox(comm)
comm.Barrier()
comm.bcast("connected", root=1)  # the ranks' connection made: a header now arrives while rank 1 is away
comm.Barrier()
if comm.rank == 1:
    tokens, zeros = np.arange(N, dtype=np.int32), np.zeros(N, np.int32)
    sent = Trajectory(7, 0, tokens, np.array([N], np.int32), zeros.astype(np.uint8), zeros.astype(np.float32),
                      zeros, np.arange(4, dtype=np.int32), "stop")  # fmt: skip
    box.send(0, sent)
    box.send(0, Stop(reason="done"))
    while not go.exists():  # outside MPI: nothing moves the Trajectory's buffers
        time.sleep(0.01)
    box.flush()
else:
    early = []
    for _ in range(100):  # a second of polls while rank 1 is away
        early += box.poll()
        time.sleep(0.01)
    assert early == [], f"delivered before the sender came back: {[type(e.msg).__name__ for e in early]}"
    go.write_text("")
    got = []
    while not got or not isinstance(got[-1].msg, Stop):
        got += box.poll()
        time.sleep(0.001)
    assert [type(e.msg).__name__ for e in got] == ["Trajectory", "Stop"], got
    assert got[0].msg.group_id == 7 and (got[0].msg.tokens == np.arange(N, dtype=np.int32)).all()
    print("OK")
