"""The benchmark scripts' pure parts (reading metrics, steady-state figures, ratios), plot_run on a
synthetic run directory, and bench_trainer's own PPO steps against the library's on a tiny model. The
benchmarks themselves are not run here: they print figures, they assert none."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from areal_hpc.arch import model_arch
from areal_hpc.controller.timeline import Timeline, read_events
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.metrics import read_metrics
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import assert_same_step
from tests.support.inputs import random_batch, revealing_optim
from tests.support.shapes import QWEN2
from tools import bench_vs_trl_grpo as trl_grpo
from tools import bench_vs_trl_summary as trl_summary
from tools.bench_figures import trajectories_per_step

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench_sync = _load("bench_async_vs_sync")
bench_trl = _load("bench_vs_trl")
bench_losses = _load("bench_policy_losses")


def _row(step, tok_s, step_s, gen_idle, train_idle, staleness=0, reward=0.5, dropped=0):
    return {
        "step": step,
        "reward/mean": reward,
        "staleness/max": staleness,
        "staleness/dropped": dropped,
        "throughput/effective_tokens_per_s": tok_s,
        "timing/step_s": step_s,
        "timing/weight_sync_s": 0.01,
        "timing/gen_idle_frac": gen_idle,
        "timing/train_idle_frac": train_idle,
    }


def _write_metrics(path: Path, rows: list[dict], torn_tail: bool = False) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + ('{"step": 9' if torn_tail else ""))


# --- bench_async_vs_sync -------------------------------------------------------------------------


def test_read_metrics_sorts_by_step_and_skips_a_torn_line(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl", [_row(2, 1, 1, 0, 0), _row(1, 1, 1, 0, 0)], torn_tail=True)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_summarize_weights_by_step_time_and_skips_warmup():
    rows = [
        _row(1, 99999.0, 5.0, 1.0, 1.0),  # warm-up: left out
        _row(2, 100.0, 1.0, 0.5, 0.0),  # 100 tokens
        _row(3, 300.0, 3.0, 0.0, 0.5, staleness=2),  # 900 tokens
    ]
    s = bench_sync.summarize(rows, warmup=1)
    assert s.steps == 2
    assert s.effective_tokens_per_s == pytest.approx(1000 / 4)  # totals over totals, not the mean of rates
    assert s.gen_idle_frac == pytest.approx(0.5 * 1 / 4)
    assert s.train_idle_frac == pytest.approx(0.5 * 3 / 4)
    assert s.step_s == pytest.approx(2.0)
    assert s.gen_s == pytest.approx((1 - 0.125) * 2.0)
    assert s.train_s == pytest.approx((1 - 0.375) * 2.0)
    assert s.staleness_max == 2
    with pytest.raises(ValueError, match="no steps after"):
        bench_sync.summarize(rows, warmup=3)


def test_ideal_ratio_and_speedup():
    assert bench_sync.ideal_ratio(1.0, 1.0) == pytest.approx(2.0)
    assert bench_sync.ideal_ratio(3.0, 1.0) == pytest.approx(4 / 3)
    assert bench_sync.ideal_ratio(0.5, 2.0) == pytest.approx(1.25)
    sync = bench_sync.summarize([_row(1, 100.0, 1.0, 0.5, 0.5)], warmup=0)
    asyn = bench_sync.summarize([_row(1, 180.0, 1.0, 0.1, 0.1)], warmup=0)
    assert bench_sync.speedup(sync, asyn) == pytest.approx(1.8)
    assert "1.8" not in bench_sync.describe("sync", sync)  # describes one run, not the ratio
    assert "100 effective tok/s" in bench_sync.describe("sync", sync)


def test_workloads_modes_and_their_order():
    from areal_hpc.config import load_config

    reasoning = bench_sync.WORKLOADS["reasoning"]
    assert bench_sync.WORKLOADS["short"].modes == ("sync", "async")  # today's runs, in today's order
    assert bench_sync.round_order(bench_sync.WORKLOADS["short"].modes, 2, False) == ("sync", "async")
    assert bench_sync.round_order(reasoning.modes, 1, True) == ("sync", "async", "async-noint")
    assert bench_sync.round_order(reasoning.modes, 2, True) == ("async-noint", "async", "sync")
    runs = {m: load_config(reasoning.config, bench_sync.mode_overrides(m, 3)).rollout for m in reasoning.modes}
    assert runs["sync"].max_staleness == 0
    assert (runs["async"].max_staleness, runs["async"].interruptible) == (3, True)
    assert (runs["async-noint"].max_staleness, runs["async-noint"].interruptible) == (3, False)
    assert load_config(reasoning.config, []).experiment.name == "tiny-reasoning-cpu"  # the run directory's parent


# --- bench_vs_trl --------------------------------------------------------------------------------


def test_trl_bench_rates():
    rows = [_row(1, 0, 10.0, 0, 0), _row(2, 0, 2.0, 0, 0), _row(3, 0, 2.0, 0, 0)]
    assert bench_trl.trajectories_per_s_from_metrics(rows, warmup=1, trajectories_per_step=64) == pytest.approx(128 / 4)
    # step ends at 10 (warm-up), 14, 18: two steps of 64 trajectories in 8 s
    assert trl_grpo.trajectories_per_s_from_step_ends([10.0, 14.0, 18.0], warmup=1, trajectories_per_step=64) == 16.0
    with pytest.raises(ValueError):
        trl_grpo.trajectories_per_s_from_step_ends([10.0], warmup=1, trajectories_per_step=64)
    assert trl_summary.ratio(32.0, 16.0) == 2.0


def test_trl_bench_workloads_share_the_systems_settings_and_keep_the_reasoning_config_as_shipped():
    from areal_hpc.config import load_config

    short, reasoning = bench_trl.WORKLOADS["short"], bench_trl.WORKLOADS["reasoning"]
    assert set(bench_trl.SYSTEMS) <= set(short.overrides) and set(reasoning.overrides) == set(bench_trl.SYSTEMS)
    for w in (short, reasoning):
        cfg = load_config(w.config, list(w.overrides))  # every override names a real setting
        assert trajectories_per_step(cfg) == 64 and cfg.ppo.prox_logp == "loglinear" and 1 <= w.warmup < w.steps
    cfg = load_config(reasoning.config, list(reasoning.overrides))
    assert cfg.rollout.max_new_tokens == 1024 and cfg.sft.examples > 0 and cfg.cluster.nodes == 2


def test_trl_bench_run_figures_and_the_line_on_what_bounds_a_ratio_below_2x():
    run = trl_summary.Run(2.0, {"mean": 300.0}, 0.8, 0.2)
    assert run.answer_tokens_per_s == 600.0
    assert trl_summary.median_of(
        [run, trl_summary.Run(4.0, {}, 0, 0), trl_summary.Run(3.0, {}, 0, 0)], "trajectories_per_s"
    ) == ("3.00 (median of 3: 2.00, 4.00, 3.00)")
    assert trl_summary.bound_line(2.0, "padded", 0.8, 0.99, 0.5) is None
    line = trl_summary.bound_line(1.5, "padded", 0.8, 0.99, 0.5)
    assert line.startswith("below 2x: TRL padded generates 80% of its step")
    assert "at most 1.25x" in line and line.endswith("bounded by its generator")  # 1 / max(0.8, 0.2)
    assert trl_summary.bound_line(1.5, "paged", 0.3, 0.4, 0.9).endswith("bounded by its trainer")


def test_weights_verdict_reads_the_sign_of_the_gain_against_its_noise():
    assert trl_grpo.weights_verdict([7.4, 7.1, 16.9, 6.1, 12.2, 18.1, 5.2, 5.7]) == "follows"
    assert trl_grpo.weights_verdict([-31.1, -15.5, -24.6, -7.3, 1.0, -1.9, -21.5, -22.3]) == "stale"
    assert trl_grpo.weights_verdict([5.0, -4.0, 6.0, -5.0]) == "unclear"  # mean 0.5, standard error 2.9
    with pytest.raises(ValueError, match="at least 2"):
        trl_grpo.weights_verdict([1.0])
    assert set(trl_grpo.VERDICTS) == {"follows", "stale", "unclear"}
    assert set(trl_grpo.TRL_SETTINGS) == {"padded", "paged", "vllm"}


def test_trl_bench_summary_prints_both_systems_lengths_and_the_ratio_last(capsys):
    from areal_hpc.config import load_config

    w = bench_trl.WORKLOADS["reasoning"]
    cfg = load_config(w.config, list(w.overrides))
    trl = {
        "padded": [trl_summary.Run(1.0, {"mean": 300.0}, 0.9, 0.1)],
        "paged": [trl_summary.Run(1.5, {"mean": 200.0}, 0.8, 0.2)],
    }
    answers = {"padded": [100, 200, 600], "paged": [50, 100, 450]}
    row = {f"rollout/answer_tokens_{k}": v for k, v in {"mean": 250, "median": 150, "p90": 600, "max": 1024}.items()}
    trl_summary.summarize(cfg, len, trl, answers, [trl_summary.Run(2.4, {"mean": 250.0}, 0.99, 0.6)], [row])
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0:2] for ln in lines[1:6]] == [
        ["task", "(chain)"],
        ["planner", "1.5B,"],
        ["TRL", "padded"],
        ["TRL", "paged"],
        ["areal-hpc", "mean"],
    ]
    assert "answer tokens/s 600.00 (median of 1: 600.00)" in lines[8]  # areal-hpc: 2.4 x 250
    assert lines[-3] == "areal-hpc/TRL paged answer tokens per second: 2.00x"  # 600 / (1.5 x 200)
    assert lines[-2].startswith("below 2x: TRL paged generates 80% of its step")
    assert lines[-1] == "areal-hpc/TRL paged (the best TRL setting here) trained trajectories per second: 1.60x"


# --- timeline and plot_run -----------------------------------------------------------------------


def _synthetic_run(run_dir: Path, steps: int = 8) -> None:
    """A run's metrics and the controller's timeline, as an asynchronous run of two generators writes them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_metrics(
        run_dir / "metrics.jsonl",
        [
            _row(s, 500.0 + 10 * s, 0.5, 0.1, 0.2, staleness=min(s - 1, 2), reward=s / steps)
            for s in range(1, steps + 1)
        ],
    )
    clock = [1000.0]
    tl = Timeline(run_dir, now=lambda: clock[0])

    def at(t, event, **fields):
        clock[0] = 1000.0 + t
        tl.mark(event, **fields)

    group = 0
    for v in range(steps):
        t = v * 1.0
        for rank in (2, 3):
            at(t + 0.01, "gen_start", rank=rank, group=group)
            at(t + 0.6, "gen_done", rank=rank, group=group)
            group += 1
        at(t + 0.05, "train_start", version=v)
        at(t + 0.5, "train_end", version=v + 1)
        at(t + 0.5, "sync_start", version=v + 1)
        at(t + 0.7, "sync_done", rank=2, version=v + 1, seconds=0.2)
        at(t + 0.75, "sync_done", rank=3, version=v + 1, seconds=0.25)
    tl.close()


def test_timeline_phases(tmp_path):
    _synthetic_run(tmp_path)
    plot_run = _load("plot_run")
    events = read_events(tmp_path)
    assert events[0]["event"] == "gen_start" and events[0]["t"] == pytest.approx(1000.01)
    lanes = plot_run.phases(events)
    assert set(lanes) == {"generator 2", "generator 3", "trainer"}
    assert lanes["generator 2"]["generate"][0] == pytest.approx((1000.01, 1000.6))
    assert lanes["generator 3"]["sync"][0] == pytest.approx((1000.5, 1000.75))
    assert lanes["trainer"]["sync"][0] == pytest.approx((1000.5, 1000.75))  # until the last SyncDone
    # step 1 is sent at 1001.05, after the sync of version 1 ended (1000.75): it trains from 1001.05
    assert lanes["trainer"]["train"][1] == pytest.approx((1001.05, 1001.5))
    assert len(lanes["trainer"]["train"]) == 8


def test_trainer_step_waits_for_the_weight_sync_before_it(tmp_path):
    plot_run = _load("plot_run")
    events = [
        {"t": 0.0, "event": "train_end", "version": 1},
        {"t": 0.0, "event": "sync_start", "version": 1},
        {"t": 0.1, "event": "train_start", "version": 1},  # queued behind the WeightSync on the trainer
        {"t": 0.4, "event": "sync_done", "rank": 2, "version": 1, "seconds": 0.4},
        {"t": 1.0, "event": "train_end", "version": 2},
    ]
    lanes = plot_run.phases(events)
    assert lanes["trainer"]["train"] == [pytest.approx((0.4, 1.0))]
    assert lanes["trainer"]["sync"] == [pytest.approx((0.0, 0.4))]


def test_plot_run_writes_a_png(tmp_path):
    _synthetic_run(tmp_path / "run")
    plot_run = _load("plot_run")
    out = tmp_path / "run.png"
    assert plot_run.main([str(tmp_path / "run"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (1200, 900)


def test_plot_run_without_timeline_or_metrics(tmp_path):
    plot_run = _load("plot_run")
    _write_metrics(tmp_path / "metrics.jsonl", [_row(1, 10.0, 1.0, 0.5, 0.5)])
    assert plot_run.main([str(tmp_path)]) == 0  # metrics only: the timeline panel says it is missing
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert plot_run.main([str(tmp_path / "nothing")]) == 2


# --- prepare_data: common layouts to the project's rows ------------------------------------------

prepare = _load("prepare_data")


def test_prepare_math_layouts(tmp_path):
    rows = [
        {"problem": "Half of 1?", "solution": "It is $\\frac{1}{2}$, so \\boxed{\\frac{1}{2}}.", "level": 2},  # MATH
        {"question": "2 apples and 3 more?", "answer": "2 + 3 = 5\n#### 1,005"},  # GSM8K
        {"prompt": "6*7=", "answer": 42},
        {"question": "no answer here", "solution": "none"},
        {"problem": "", "answer": "1"},
    ]
    src = tmp_path / "math.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shown = []
    assert prepare.convert(src, tmp_path / "out.jsonl", "math", show=shown.append) == 3
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out == [
        {"prompt": "Half of 1?", "answer": "\\frac{1}{2}"},
        {"prompt": "2 apples and 3 more?", "answer": "1005"},
        {"prompt": "6*7=", "answer": "42"},
    ]
    assert "skipped 2 rows" in shown[1] and f"{src}:4: no answer" in shown[2] and f"{src}:5: no prompt" in shown[2]
    with pytest.raises(prepare.ConfigError, match="no row could be converted"):
        prepare.convert(src, tmp_path / "x.jsonl", "math", target_field="nothing")
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.partial").exists()
    src.write_text(src.read_text() + '{"problem": "1+1?", "answer": \n')  # a malformed last line
    with pytest.raises(prepare.ConfigError, match=f"{src}:6: not valid JSON"):
        prepare.convert(src, tmp_path / "y.jsonl", "math", show=shown.append)
    assert not list(tmp_path.glob("y.jsonl*")), "nothing half-written stays behind"


def test_prepare_code_layouts_from_parquet_and_the_command_line(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"question": "add", "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},  # APPS
        {"question": "echo", "input_output": json.dumps([{"input": "a", "output": "a"}])},
        {"question": "broken", "input_output": "{not json"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "apps.parquet")
    assert prepare.main([str(tmp_path / "apps.parquet"), "--kind", "code", "-o", str(tmp_path / "c.jsonl")]) == 0
    assert "wrote 2 code rows" in capsys.readouterr().out
    from areal_hpc.data.dataset import load_dataset

    got = [e.target for e in load_dataset(tmp_path / "c.jsonl", "code")]
    assert got == [[{"input": "1 2\n", "output": "3\n"}], [{"input": "a", "output": "a"}]]
    contests = {"description": "sum", "public_tests": {"input": [["1", "2"]], "output": [3]}}  # stdin as lines
    assert prepare.convert_row(contests, "code") == {"prompt": "sum", "tests": [{"input": "1\n2", "output": "3"}]}
    assert prepare.main([str(tmp_path / "missing.jsonl"), "--kind", "code", "-o", str(tmp_path / "d.jsonl")]) == 2
    assert "data not found" in capsys.readouterr().err


# --- bench_trainer: its own steps train what ppo_step trains -----------------------------------------


def _bench_steps_rank(par, model_dir):
    """From the same weights each: ppo_step and bench_trainer's padded step on two minibatches, ppo_step
    and its step with the prox pass on one; each one's stats and exported weights."""
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step
    from tools import bench_trainer

    batch = random_batch(model_arch(QWEN2).vocab_size)
    one_minibatch = dataclasses.replace(batch, microbatches=[[[0, 1], [2], [3], [4, 5]]])
    steps = {
        "packed": (ppo_step, batch),
        "padded": (bench_trainer.padded_step, batch),
        "recompute-1": (ppo_step, one_minibatch),
        "recompute-1-pass": (bench_trainer.prox_pass_step, one_minibatch),
    }
    out = {}
    for name, (step, step_batch) in steps.items():
        engine = Engine(model_dir, par, revealing_optim())
        stats = step(engine, step_batch, StepConfig())
        out[name] = {"stats": stats, "weights": {k: v.cpu() for k, v in engine.export_full().items()}}
    return out


@pytest.mark.megatron
@pytest.mark.slow
def test_bench_trainer_steps_train_the_step_ppo_step_trains(tmp_path):
    """bench_trainer times ppo_step beside its own variants of it: one padded row per sequence (what packing
    saves) and, with one minibatch, the prox pass that ppo_step skips (taking the prox logprobs from the
    training pass: the same values). Each variant trains the same step: the timings compare the same work."""
    model_dir = build_tiny_model(QWEN2, tmp_path, seed=5)
    got = run_ranks(_bench_steps_rank, 1, 1, 1, str(model_dir))[0]
    assert_same_step(got["padded"], got["packed"])
    assert_same_step(got["recompute-1-pass"], got["recompute-1"])


# --- bench_policy_losses ------------------------------------------------------------------------


def test_policy_loss_benchmark_variants_are_valid_configs_and_its_fifths():
    from areal_hpc.config import load_config

    chosen = {name: load_config(bench_losses.CONFIG, o).ppo for name, o in bench_losses.VARIANTS.items()}
    assert {c.policy_loss for c in chosen.values()} == {"decoupled", "gspo", "cispo"}
    assert {c.loss_agg for c in chosen.values()} == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum"}
    assert list(chosen["behav_range"].behav_weight_cap) == [0.5, 2.0]
    rows = [{"reward/mean": r} for r in [0.1] * 4 + [0.2] * 4 + [0.2] * 4 + [0.3] * 4 + [0.4] * 5]
    by_fifth = bench_losses.fifths(rows, "reward/mean")
    assert by_fifth == pytest.approx([0.1, 0.2, 0.2, 0.3, 0.4])  # the last fifth takes the 21st row
    assert bench_losses.learned(by_fifth)
    assert not bench_losses.learned([0.1, 0.2, 0.05, 0.3, 0.4])  # a fifth below the first
    assert not bench_losses.learned([0.1, 0.12, 0.12, 0.13, 0.14])  # less than RISE
    with pytest.raises(ValueError, match="fewer than five"):
        bench_losses.fifths(rows[:4], "reward/mean")
