"""`areal_hpc.trainer.spawn.run_ranks`: its CPU ranks are forks of a server started once a process, yet each
call's ranks take the caller's environment and output of that moment, not the server's; a failing rank fails
the call with its traceback. Slow: the server's start imports Megatron (8 s), in each worker of the unit tier
that would run it."""

import os

import pytest

from areal_hpc.trainer.spawn import run_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

NAME = "AREAL_SPAWN_TEST"


def _report(par):
    value = os.environ.get(NAME, "unset")
    os.write(1, f"rank {par.rank}: {value}\n".encode())  # one write: the ranks print at once
    return value


def _fail(par):
    raise ValueError(f"rank {par.rank} refuses")


def test_each_calls_ranks_take_the_callers_environment_and_output(monkeypatch, capfd):
    """The server starts (here, or in an earlier test) with another stdout than the one captured below and
    without NAME in its environment."""
    with capfd.disabled():
        assert run_ranks(_report, 1, 1, 1, device="cpu") == {0: "unset"}
    for value in ("first", "second"):
        monkeypatch.setenv(NAME, value)
        assert run_ranks(_report, 2, 1, 1, device="cpu") == {0: value, 1: value}
        lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("rank ")]
        assert sorted(lines) == [f"rank 0: {value}", f"rank 1: {value}"]


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)Traceback.*ValueError: rank 1 refuses"):
        run_ranks(_fail, 2, 1, 1, device="cpu")
