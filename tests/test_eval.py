"""`areal-hpc eval`: the pass@k estimator against hand-computed cases, the report, what a target names,
the evaluation between training steps (the simulated world of tests/support/sim_world.py), and one evaluation with a
real vLLM engine and the reward workers' scorer pool on the tiny model."""

import json
import re
from math import comb
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.config import ConfigError, load_config
from areal_hpc.data.dataset import Example
from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.eval import EvalRound, ks, pass_at_k
from areal_hpc.eval.command import resolve
from areal_hpc.eval.training import TrainingEval
from areal_hpc.protocol import EvalTrajectory
from tests.support.sim_world import Prompts, World, make, metrics, run


def test_pass_at_k_by_hand():
    # n = 5 trajectories, c = 2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n = 10, c = 3, k = 4: 1 - C(7,4)/C(10,4) = 1 - 35/210.
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong trajectories: every k of them hold a right one
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert ks(16) == [1, 2, 4, 8, 16] and ks(6) == [1, 2, 4, 6] and ks(1) == [1]


@given(n=st.integers(1, 40), c=st.integers(0, 40), k=st.integers(1, 40))
def test_pass_at_k_is_the_binomial_ratio(n, c, k):
    c, k = min(c, n), min(k, n)
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_round_report():
    examples = [Example(i, f"p{i}", "1", "math", f"f:{i + 1}") for i in range(3)]
    r = EvalRound(examples, samples=4)
    rewards = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    for i, rs in enumerate(rewards):
        for j, x in enumerate(rs):
            r.arrived(i, j, length=2 + j, truncated=j == 3)
            assert not r.done
            if (i, j) == (2, 1):
                r.lost(i, j)  # the workflow raised
            else:
                r.scored(i, j, x, "ok" if i or j else "timeout")
    assert r.done and r.generated(2)
    rep = r.report()
    assert rep["pass@k"]["1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert rep["pass@k"]["2"] == pytest.approx((0.5 + 1 + 0) / 3)  # one right of 4: 1 - C(3,2)/C(4,2)
    assert rep["pass@k"]["4"] == pytest.approx(2 / 3)
    assert rep["episode_tokens"] == {"mean": 3.5, "median": 3.5, "p90": pytest.approx(5.0), "max": 5}
    assert rep["truncated_frac"] == 0.25 and rep["reward_errors"] == rep["workflow_errors"] == 1
    assert [p["correct"] for p in rep["per_prompt"]] == [1, 4, 0]
    empty = EvalRound(examples[:1], samples=1)
    assert not empty.generated(0)
    empty.arrived(0, 0, length=0, truncated=False)
    assert empty.generated(0), "a trajectory without a token has come back too"


def test_what_a_target_names(tmp_path):
    from areal_hpc.checkpoint.files import mark_complete
    from areal_hpc.data.tiny import build_tiny_model
    from areal_hpc.rundir import prepare_run_dir

    model = build_tiny_model(load_config().model, tmp_path, seed=1)
    cfg, path, step = resolve(model, None, ["rollout.temperature=0.5"])
    assert path == model and step is None and cfg.rollout.temperature == 0.5
    with pytest.raises(ConfigError, match="--step applies to a run directory"):
        resolve(model, 3, [])
    with pytest.raises(ConfigError, match="neither a Hugging Face model directory"):
        resolve(tmp_path, None, [])
    run_cfg = load_config("configs/tiny-cpu.yaml", [f"experiment.root={tmp_path}", "sft.examples=0"])
    run_dir = prepare_run_dir(run_cfg)
    with pytest.raises(ConfigError, match="no complete checkpoint yet; --step 0"):
        resolve(run_dir, None, [])
    cfg, path, step = resolve(run_dir, 0, [])
    assert step == 0 and (path / "config.json").is_file() and cfg.model.hidden_size == 128  # the run's own
    (run_dir / "checkpoints" / "step_5").mkdir()
    with pytest.raises(ConfigError, match=r"no complete checkpoint of step 5 \(complete: none"):
        resolve(run_dir, 5, [])
    mark_complete(run_dir / "checkpoints" / "step_5")
    with pytest.raises(ConfigError, match=r"no complete checkpoint of step 7 \(complete: \[5\]"):
        resolve(run_dir, 7, [])
    # COMPLETE without the trainer's part: the exporter's refusal, as a config error naming the step
    with pytest.raises(ConfigError, match=r"has no complete checkpoint under checkpoints/"):
        resolve(run_dir, None, [])


def test_eval_between_training_steps(tmp_path):
    """Eval prompts go to the generators after every 4th step (and before the first), come back scored,
    are never trained on, never pass the staleness gate, and their pass@1 is the hand-counted one."""
    from collections import Counter

    from areal_hpc.exit_codes import EXIT_DONE
    from areal_hpc.protocol import Envelope, GenerateRequest, RewardRequest, RewardResult

    samples = 4

    class EvalWorld(World):
        """Scores the s-th trajectory of eval prompt i (its target "eval i"; s counts the prompt's reward
        requests of a round, in the order they come) right when -1 - (i * samples + s) is divisible by 3.
        Records which requests ask for eval prompts and which for training groups."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scored, self.requests = Counter(), Counter()

        def send(self, dest, msg):
            if isinstance(msg, GenerateRequest):
                self.requests["eval" if msg.eval else "group"] += 1
            if isinstance(msg, RewardRequest) and msg.target.startswith("eval "):
                i = int(msg.target.split()[1])
                s, self.scored[i] = self.scored[i] % samples, self.scored[i] + 1
                right = (-1 - (i * samples + s)) % 3 == 0
                self.later.append((1, Envelope(dest, RewardResult(msg.request_id, float(right), "ok"))))
                return
            super().send(dest, msg)

    tok = build_tokenizer()
    rows = [{"prompt": f"{7 * i}*{i}=", "answer": f"eval {i}"} for i in range(5)]
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, layout, run_dir, tok_dir = make(tmp_path, "eval.every_steps=4", f"eval.data={data}", f"eval.samples={samples}")
    world = EvalWorld(layout, tok, seed=5)
    c, code = run(cfg, layout, run_dir, tok_dir, world, Prompts())
    assert code == EXIT_DONE
    # trajectory s of prompt i is right when -1 - (i * samples + s) is divisible by 3
    correct = [sum((-1 - (i * samples + s)) % 3 == 0 for s in range(samples)) for i in range(len(rows))]
    assert correct == [1, 1, 2, 1, 1]
    want = np.mean([pass_at_k(samples, c_, 2) for c_ in correct])
    rows_out = metrics(run_dir)
    evals = [r for r in rows_out if "eval/pass@1" in r]
    assert [r["eval/version"] for r in evals] == [0, 4, 8]
    assert all(r["eval/pass@1"] == pytest.approx(6 / 20) and r["eval/pass@2"] == pytest.approx(want) for r in evals)
    assert all(set(r) >= {"eval/pass@2", "eval/reward_mean", "eval/episode_tokens_mean"} for r in evals)
    assert not {r["prompt"] for r in rows} & set(world.trained_prompts), "an eval prompt was trained on"
    assert c.rollouts.gate.state.consumed == 12 * 4 and c.rollouts.gate.state.rejected == 0
    assert world.requests["eval"] == 3 * len(rows) and sum(world.scored.values()) == 3 * len(rows) * samples
    assert world.requests["group"] == c.prompts.position, "every generation request is a prompt group's"


def test_training_eval_rounds_by_hand():
    """Due every 2 versions; a round still running when the next is due skips that one; its figures come
    once, with the version it started on."""
    examples = [Example(i, f"p{i}", "1", "math", prompt_ids=np.array([5 + i, 6], np.int32)) for i in range(2)]
    ev = TrainingEval(examples, samples=2, every_steps=2)
    assert ev.start(1) == [], "not due"
    requests = ev.start(0)
    assert [(r.group_id, list(r.prompt_ids), r.n, r.eval) for r in requests] == [
        (0, [5, 6], 2, True),
        (1, [6, 6], 2, True),
    ]
    assert requests[1].row == {"prompt": "p1", "target": "1", "kind": "math"}
    assert ev.start(2) == [], "the round of version 0 still runs: none of version 2"
    trajs = [EvalTrajectory(i, j, np.full(j + 1, 7, np.int32), j + 3, "stop") for i in range(2) for j in range(2)]
    assert [ev.arrived(t) for t in trajs] == [False, True, False, True], "a prompt's last trajectory ends its request"
    for t in trajs:
        assert ev.target(t) == "1" and ev.take_metrics() == {}
        if t.prompt_index == 0:
            ev.scored(t, 1.0, "ok")
        else:
            ev.lost(t)  # a lost episode scores 0 and ends the round like a scored one
    m = ev.take_metrics()
    assert m["eval/version"] == 0 and m["eval/pass@1"] == m["eval/pass@2"] == m["eval/reward_mean"] == 0.5
    assert m["eval/episode_tokens_mean"] == 3.5 and ev.take_metrics() == {}  # the episodes' tokens (num_tokens)
    assert len(ev.start(4)) == 2 and ev.version == 4


TWO_TURNS = """
from areal_hpc.workflow import Workflow


class TwoTurns(Workflow):
    async def arun_episode(self, client, row):
        first = await client.generate(row["prompt_ids"], max_tokens=2)
        if row["prompt"].startswith("1"):
            raise RuntimeError("lost on purpose")
        await client.generate([*row["prompt_ids"], *first.token_ids, *row["prompt_ids"]], max_tokens=3)
        return 1.0
"""


@pytest.mark.vllm
def test_evaluate_with_the_generator_engine_and_scorer_pool(tmp_path):
    """Real evaluations on one engine: the tiny model's warm start (a few hundred examples) on held-out
    problems with the default workflow, scored by the reward workers' pool; then a workflow of two turns
    that returns its own reward, and raises on some prompts."""
    from areal_hpc.data.dataset import eval_path, load_prompts
    from areal_hpc.data.initial_model import initial_model
    from areal_hpc.eval.command import evaluate, table
    from areal_hpc.generator.engine import GenerationEngine

    overrides = [
        f"experiment.root={tmp_path}",
        "sft.examples=600",
        "sft.unboxed=0",  # every answer boxed: so few examples still get some held-out problems right
        "rollout.max_new_tokens=8",
        "rollout.max_concurrent=8",
    ]
    cfg = load_config("configs/tiny-cpu.yaml", overrides)
    model = initial_model(cfg)
    engine = GenerationEngine.from_config(cfg, model, "cpu")
    try:
        shown = []
        report = evaluate(cfg, model, eval_path(cfg), samples=4, engine=lambda: engine, progress=shown.append)
        assert re.fullmatch(r"eval: the episodes' OpenAI endpoint: http://127\.0\.0\.1:\d+/v1 \S+", shown[0]), shown
        n = len(load_prompts(cfg, build_tokenizer(), eval_path(cfg)))
        assert report["prompts"] == n == 40 and report["samples"] == 4
        assert [p["correct"] for p in report["per_prompt"]] and all(
            0 <= p["correct"] <= 4 for p in report["per_prompt"]
        )
        assert report["pass@k"]["1"] == pytest.approx(np.mean([p["correct"] / 4 for p in report["per_prompt"]]))
        assert report["pass@k"]["1"] == pytest.approx(report["reward_mean"])  # math rewards are 0 or 1
        assert report["pass@k"]["1"] <= report["pass@k"]["2"] <= report["pass@k"]["4"]
        prompt_tokens = {
            i: len(e.prompt_ids) for i, e in enumerate(load_prompts(cfg, build_tokenizer(), eval_path(cfg)))
        }
        answers = [t - prompt_tokens[i] for i, p in enumerate(report["per_prompt"]) for t in p["tokens"]]
        assert min(answers) >= 1 and max(answers) <= 8, "an episode of SingleTurn: the prompt and one answer"
        assert report["truncated_frac"] <= np.mean([a == 8 for a in answers])
        assert report["pass@k"]["4"] > 0, "the warm start answers some held-out problems right"
        assert report["episodes"]["turns_mean"] == 1 and report["workflow_errors"] == 0
        assert "pass@1" in table({**report, "step": 0})

        workflow = tmp_path / "two_turns.py"
        workflow.write_text(TWO_TURNS)
        data = tmp_path / "held_out.jsonl"
        prompts = ["1+1=", "2+5=", "13+4=", "7-3="]
        data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
        cfg = load_config("configs/tiny-cpu.yaml", [*overrides, f"rollout.workflow={workflow}:TwoTurns"])
        report = evaluate(cfg, model, data, samples=3, engine=lambda: engine, progress=lambda line: None)
    finally:
        engine.close()
    lost = [p.startswith("1") for p in prompts]
    # the workflow's 1.0 wins over reward.kind (every answer "0" is wrong); a lost episode scores 0
    assert [p["correct"] for p in report["per_prompt"]] == [0 if x else 3 for x in lost]
    assert report["workflow_errors"] == 3 * sum(lost) and report["reward_errors"] == 0, "lost: counted once"
    assert "lost on purpose" in report["episodes"]["first_error"]
    assert report["episodes"]["turns_mean"] == pytest.approx(2 * (len(prompts) - sum(lost)) / len(prompts))
    assert all(t == 0 for p, x in zip(report["per_prompt"], lost) if x for t in p["tokens"]), "lost: no tokens"
    assert "lost (the workflow raised): 6" in table({**report, "step": 0})


def eval_args(*argv):
    from areal_hpc.cli import build_parser

    return build_parser().parse_args(["eval", *argv])


def test_steps_and_step_or_one_output_for_several_steps_are_refused():
    from areal_hpc.cli import cmd_eval

    with pytest.raises(ConfigError, match=r"give --step N \(one checkpoint\) or --steps A,B,... \(several\), not both"):
        cmd_eval(eval_args("runs/x/trial0", "--step", "3", "--steps", "1,2"))
    with pytest.raises(ConfigError, match="-o names one report; --steps writes one per step"):
        cmd_eval(eval_args("runs/x/trial0", "--steps", "1,2", "-o", "r.json"))


def test_eval_array_script(tmp_path):
    from areal_hpc.launch.eval_array import eval_array_script
    from areal_hpc.planner import resolve_split
    from areal_hpc.rundir import prepare_run_dir

    cfg, _ = resolve_split(
        load_config(
            "configs/qwen1.5b.yaml", [f"experiment.root={tmp_path}", "cluster.partition=gpu", "cluster.account=rl"]
        )
    )
    run_dir = prepare_run_dir(cfg).resolve()  # as a launcher prepares it
    args = eval_args(str(run_dir), "--steps", "100,200,300", "--data", "aime.jsonl", "--samples", "8", "--submit")
    args.overrides = ["rollout.temperature=0.6"]
    where, script = eval_array_script(args)
    assert where == run_dir
    lines = script.splitlines()
    for want in ["#SBATCH --array=0-2", "#SBATCH --nodes=1", "#SBATCH --gpus-per-node=1", "#SBATCH --partition=gpu"]:
        assert want in lines
    assert "#SBATCH --cpus-per-task=14" in lines, "a run's engine's share: 112 CPUs of a node over its 8 engines"
    assert "#SBATCH --account=rl" in lines and f"#SBATCH --output={run_dir}/eval/slurm/%A_%a.out" in lines
    assert "steps=(100 200 300)" in lines
    command = next(line for line in lines if line.startswith("exec "))
    assert f"-m areal_hpc.cli eval {run_dir} --data {Path.cwd() / 'aime.jsonl'} --samples 8" in command
    assert command.endswith('rollout.temperature=0.6 --step "$step"')
    args.overrides = ["allocation.gen_tp=2"]
    assert "#SBATCH --cpus-per-task=28" in eval_array_script(args)[1].splitlines(), "2 GPUs' share of the node"
    args.overrides = []
    cfg_file = run_dir / "config.yaml"
    cfg_file.write_text(cfg_file.read_text().replace("container: ''", "container: nvcr.io/areal:1"))
    command = next(line for line in eval_array_script(args)[1].splitlines() if line.startswith("exec "))
    assert command.startswith("exec srun --ntasks=1 --cpus-per-task=14 --container-image=nvcr.io/areal:1 "), (
        "the step asks again: srun does not take --cpus-per-task from the allocation"
    )
    assert " python -u -m areal_hpc.cli eval " in command, "the image's python"
    for bad, message in [(["--step", "3"], "no --step"), ([], "needs --steps")]:
        args = eval_args(str(run_dir), "--submit", *bad, *(["--steps", "1"] if bad else []))
        with pytest.raises(ConfigError, match=message):
            eval_array_script(args)


@pytest.mark.slurm
@pytest.mark.vllm
def test_eval_array_runs_on_slurm(tmp_path, slurm_cluster):
    """`areal-hpc eval RUN_DIR --steps 0 --submit` on the local Slurm cluster: the array task writes its report."""
    import subprocess
    import sys
    import time

    from areal_hpc.rundir import prepare_run_dir

    cfg = load_config("configs/tiny-cpu.yaml", [f"experiment.root={tmp_path}", "sft.examples=0"])
    run_dir = prepare_run_dir(cfg).resolve()
    data = tmp_path / "held_out.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+5=", "answer": "7"}\n')
    cmd = [sys.executable, "-m", "areal_hpc.cli", "eval", str(run_dir), "--steps", "0", "--submit"]
    out = subprocess.run([*cmd, "--data", str(data), "--samples", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "submitted job array" in out.stdout, out.stdout + out.stderr
    report = run_dir / "eval" / "step_0-held_out.json"
    deadline = time.monotonic() + 400
    while not report.exists():
        logs = "".join(p.read_text() for p in (run_dir / "eval" / "slurm").glob("*_0.out"))
        assert time.monotonic() < deadline, f"no report after 400 s; task log:\n{logs[-3000:]}"
        assert "Traceback" not in logs, logs[-3000:]
        time.sleep(2)
    got = json.loads(report.read_text())
    assert got["step"] == 0 and got["prompts"] == 2 and got["samples"] == 2 and set(got["pass@k"]) == {"1", "2"}


def test_bad_eval_data_is_one_line_before_any_engine(tmp_path, capsys, monkeypatch):
    from areal_hpc.cli import main
    from areal_hpc.data.tiny import build_tiny_model
    from areal_hpc.eval import command

    monkeypatch.setattr(command, "_engine", lambda *args: pytest.fail("an engine was started"))
    model = build_tiny_model(load_config().model, tmp_path, seed=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": null}\n')
    assert main(["eval", str(model), "--data", str(bad), "--samples", "2"]) == 2
    assert f"config error: {bad}:2: field 'answer'" in capsys.readouterr().err
    assert main(["eval", str(model), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "data not found" in capsys.readouterr().err
    # the same file as eval.data of a run: the controller stops at start with the loader's message
    from areal_hpc.controller import Controller
    from areal_hpc.rank_context import RankContext

    cfg, layout, run_dir, tok_dir = make(tmp_path, "eval.every_steps=5", f"eval.data={bad}")
    with pytest.raises(ConfigError, match=f"{bad}:2: field 'answer'"):
        Controller(
            RankContext(cfg, layout, None, None, run_dir, tok_dir, None), mailbox=World(layout, build_tokenizer())
        )
