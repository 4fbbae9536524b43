"""The figures of the benchmark scripts (tools.bench_figures): answer-length rows, bounds, shares."""

import pytest

from areal_hpc.config import load_config
from areal_hpc.data.synthetic import worked_steps
from tools.bench_figures import (
    below_2x_line,
    bounds_line,
    dropped_share,
    format_lengths,
    ideal_ratio,
    interruption_line,
    last_fifth_reward,
    occupancy,
    planner_lengths,
    run_lengths,
    steady_rows,
    task_lengths,
    trained_over_generated_p90,
)


def test_planner_lengths_are_the_papers_at_its_cap_and_the_same_shape_at_a_smaller_one():
    paper = planner_lengths(27648)
    assert paper["mean"] == pytest.approx(2319, rel=0.01) and paper["median"] == pytest.approx(1274, rel=0.01)
    small = planner_lengths(1024)
    assert small["mean"] / 1024 == pytest.approx(paper["mean"] / 27648, rel=0.02) and small["max"] == 1024
    assert small["median"] < small["mean"] < small["p90"] < 1024


def test_steady_rows_leave_out_the_warm_up_and_say_when_none_is_left():
    rows = [{"step": s} for s in (1, 2, 3)]
    assert steady_rows(rows, 1) == rows[1:] and steady_rows(rows, 0) == rows
    with pytest.raises(ValueError, match="no steps after the 3 warm-up steps \\(3 rows\\)"):
        steady_rows(rows, 3)


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


def _steps(*answers, dropped=0):
    return [
        {"rollout/answer_tokens_mean": m, "rollout/answer_tokens_max": x, "staleness/dropped": dropped}
        for m, x in answers
    ]


def test_dropped_share_is_of_the_trajectories_generated():
    rows = _steps((100, 400), (100, 400), dropped=8)  # 16 dropped, 2 x 64 trained
    assert dropped_share(rows, 64) == pytest.approx(16 / (16 + 128))
    assert dropped_share(_steps((100, 400)), 64) == 0.0


def test_trained_over_generated_p90_leaves_out_steps_where_nothing_came():
    rows = [
        {"rollout/trained_tokens_p90": t, "rollout/generated_tokens_p90": g}
        for t, g in ((400, 500), (500, 0), (600, 600), (440, 550))
    ]
    assert trained_over_generated_p90(rows) == pytest.approx(0.8)  # the median of 0.8, 1.0, 0.8
    with pytest.raises(ValueError, match="no step"):
        trained_over_generated_p90(rows[1:2])


def test_last_fifth_reward_is_the_mean_of_the_last_steps():
    rows = [{"reward/mean": r} for r in (0.0,) * 8 + (0.5, 0.3)]
    assert last_fifth_reward(rows) == pytest.approx(0.4)
    assert last_fifth_reward(rows[:3]) == 0.0  # at least one step


def test_occupancy_is_the_mean_share_of_each_batchs_longest_answer():
    assert occupancy(_steps((100, 400), (300, 400))) == pytest.approx((0.25 + 0.75) / 2)
    assert occupancy(_steps((1024, 1024))) == 1.0


def test_bounds_and_interruption_and_below_2x_lines():
    assert ideal_ratio(1.0, 1.0) == pytest.approx(2.0) and ideal_ratio(3.0, 1.0) == pytest.approx(4 / 3)
    line = bounds_line(3.0, 1.0, 4.5, 1.0, 1.5)
    assert "G, T = 1.33x" in line and "= 3.00x (async bounded by training: G 1.00 s, T 1.50 s)" in line
    assert "bounded by generation" in bounds_line(3.0, 1.0, 4.5, 2.0, 1.5)
    assert interruption_line(1.09, [1.07, 0.98]) == "interruption (async / async-noint): +9% (rounds +7%, -2%)"
    assert interruption_line(0.9, [0.9]).startswith("interruption (async / async-noint): -10%")
    assert below_2x_line(3.0, 1.0, 4.0, 0.28) == (
        "below 2x: generation is 75% of the sync step, training 25%, answers fill 28% of the batch"
    )
