"""Typed messages between two real MPI ranks, for tests/test_protocol.py: rank 1 sends 50 episodes
(Trajectory: arrays of four dtypes, a dict of stats, a NaN reward, every third one lost with its traceback)
and a Stop, rank 0 checks that each arrives in order, its arrays bit-exact, and prints `OK 50`.

    mpirun -n 2 python tests/support/mpi/messages.py
"""

import numpy as np
from mpi4py import MPI

from areal_hpc.protocol import Mailbox, Stop, Trajectory

comm = MPI.COMM_WORLD
box = Mailbox(comm)
if comm.rank == 1:
    for i in range(50):
        box.send(
            0,
            Trajectory(
                group_id=i,
                index=i % 3,
                tokens=np.arange(2 * i, dtype=np.int32),
                seq_lens=np.array([i, i], np.int32),
                loss_mask=(np.arange(2 * i) % 2).astype(np.uint8),
                behav_logprobs=np.linspace(-1, 0, 2 * i, dtype=np.float32),
                versions=np.full(2 * i, i, np.int32),
                answer_ids=np.arange(i, dtype=np.int32),
                finish_reason="stop",
                reward=float("nan") if i % 2 else i / 10,
                stats={"turns": i, "tool_s": 0.5},
                error="Traceback ...\nValueError: x" if i % 3 == 0 else "",
            ),
        )
    box.send(0, Stop(reason="done"))
    box.flush()
else:
    got = []
    while True:
        env = box.recv(timeout_s=30)
        if isinstance(env.msg, Stop):
            break
        got.append(env.msg)
    assert [t.group_id for t in got] == list(range(50)), "in order"
    for i, t in enumerate(got):
        assert t.tokens.dtype == np.int32 and (t.tokens == np.arange(2 * i)).all()
        assert t.seq_lens.tolist() == [i, i] and t.answer_ids.tolist() == list(range(i))
        assert t.loss_mask.dtype == np.uint8 and (t.loss_mask == np.arange(2 * i) % 2).all()
        assert t.versions.shape == (2 * i,) and (t.versions == i).all()
        assert (np.isnan(t.reward) if i % 2 else t.reward == i / 10) and t.stats == {"turns": i, "tool_s": 0.5}
        assert t.error == ("Traceback ...\nValueError: x" if i % 3 == 0 else "")
        assert np.allclose(t.behav_logprobs, np.linspace(-1, 0, 2 * i))
        assert t.finish_reason == "stop" and t.index == i % 3
    print("OK", len(got))
