"""A data-parallel replica's first rank relays the controller's messages to its peers, for
tests/test_protocol.py: rank 0 (the controller) sends three 4 MiB batches and a Stop to rank 1, the
first of the replica of ranks 1..3; each of them prints `OK first|peer <replica rank>` after getting all,
in order and intact.

    mpirun -n 4 python tests/support/mpi/relay_world.py
"""

import time

import numpy as np
from mpi4py import MPI

from areal_hpc.protocol import Mailbox, ReplicaRelay, Stop, TrainBatch

world = MPI.COMM_WORLD
box = Mailbox(world)
replica = world.Split(color=0 if world.rank else MPI.UNDEFINED, key=world.rank)  # ranks 1..3
n = 1 << 20  # 4 MiB arrays: past any eager limit, they move only while the sender is inside MPI
if world.rank == 0:  # the controller: rank 1 is the replica's first rank
    for i in range(3):
        z = np.zeros(n, np.float32)
        box.send(
            1,
            TrainBatch(
                i, np.full(n, i, np.int32), np.array([0, n], np.int32), z.astype(np.uint8), z, z, z.astype(np.int32)
            ),
        )
    box.send(1, Stop("done"))
    box.flush()
else:
    inbox = ReplicaRelay(box, replica, source=0, timeout_s=30)
    got, deadline = [], time.monotonic() + 60
    while not got or not isinstance(got[-1], Stop):
        envs = inbox.poll()
        assert all(env.source == 0 for env in envs)
        got += [env.msg for env in envs]
        if inbox.first and envs:
            time.sleep(1)  # a collective outside MPI: the peers must already have what came
        assert time.monotonic() < deadline, got
        time.sleep(0.001)
    assert [m.version for m in got[:-1]] == [0, 1, 2], "in order"
    assert all((m.tokens == m.version).all() and m.tokens.size == n for m in got[:-1])
    print("OK", "first" if inbox.first else "peer", replica.Get_rank())
