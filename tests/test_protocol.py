"""Typed messages over real MPI ranks: arrays arrive bit-exact as buffers, scalars intact; a receiver is
not held by a sender gone from MPI, and keeps each sender's order; a replica's first rank relays the
controller's messages to the others in order; a rank that arrives first at a collective waits asleep."""

import pytest

from tests.support.helpers import MPI_PROGRAMS

pytestmark = pytest.mark.mpi


def test_messages_cross_ranks_intact(run_mpi):
    r = run_mpi(MPI_PROGRAMS / "messages.py", n=2)
    assert r.returncode == 0, r.stderr
    assert "OK 50" in r.stdout


def test_a_sender_outside_mpi_holds_no_receiver_and_order_is_kept(run_mpi, tmp_path):
    r = run_mpi(MPI_PROGRAMS / "slow_sender.py", n=2, timeout=60, args=[str(tmp_path)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


def test_replica_relay_passes_on_in_order(run_mpi):
    r = run_mpi(MPI_PROGRAMS / "relay_world.py", n=4)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split("\n")[:3]) == ["OK first 0", "OK peer 1", "OK peer 2"], r.stdout


def test_a_rank_waits_for_a_late_one_asleep_and_can_give_up(run_mpi):
    r = run_mpi(MPI_PROGRAMS / "late_rank.py", n=2, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK"), r.stdout
