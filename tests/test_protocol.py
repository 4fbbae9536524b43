"""Typed messages over real MPI ranks: arrays arrive bit-exact as buffers, scalars intact."""

import pytest

from tests.helpers import MPI_PROGRAMS

pytestmark = pytest.mark.mpi


def test_messages_cross_ranks_intact(run_mpi):
    r = run_mpi(MPI_PROGRAMS / "messages.py", n=2)
    assert r.returncode == 0, r.stderr
    assert "OK 50" in r.stdout
