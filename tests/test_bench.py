"""The answer-length rows of the benchmark scripts (areal_hpc.bench)."""

import pytest

from areal_hpc.bench import format_lengths, planner_lengths, run_lengths, task_lengths
from areal_hpc.config import load_config
from areal_hpc.synthetic import worked_steps


def test_planner_lengths_are_the_papers_at_its_cap_and_the_same_shape_at_a_smaller_one():
    paper = planner_lengths(27648)
    assert paper["mean"] == pytest.approx(2319, rel=0.01) and paper["median"] == pytest.approx(1274, rel=0.01)
    small = planner_lengths(1024)
    assert small["mean"] / 1024 == pytest.approx(paper["mean"] / 27648, rel=0.02) and small["max"] == 1024
    assert small["median"] < small["mean"] < small["p90"] < 1024


def test_run_lengths_pool_the_steps_rows():
    rows = [
        {
            "rollout/answer_tokens_mean": m,
            "rollout/answer_tokens_median": md,
            "rollout/answer_tokens_p90": p,
            "rollout/answer_tokens_max": x,
        }
        for m, md, p, x in ((100, 50, 300, 900), (200, 70, 500, 1024), (300, 90, 400, 700))
    ]
    assert run_lengths(rows) == {"mean": 200.0, "median": 70.0, "p90": 400.0, "max": 1024}
    assert "mean   200  median    70  p90   400  max  1024  (0.20 of the cap)" in format_lengths(
        "run", run_lengths(rows), 1000
    )
    with pytest.raises(ValueError):
        run_lengths([])


def test_task_lengths_count_the_worked_answer_and_stop_at_the_cap():
    cfg = load_config("configs/tiny-reasoning-cpu.yaml", [])
    s = task_lengths(cfg, len, n=500)  # one token a character
    assert s["median"] < s["mean"] < s["p90"] < s["max"] == 1024  # long-tailed, capped
    capped = task_lengths(load_config("configs/tiny-reasoning-cpu.yaml", ["rollout.max_new_tokens=300"]), len, n=500)
    assert capped["max"] == 300 and capped["mean"] < s["mean"]
    assert len(worked_steps("chain", "23%7=") + "\\boxed{2}") + 1 == 17  # what one row counts: '16,9,2,\boxed{2}' + eos
