"""On-policy distillation in the trainer (distill.teacher): the teacher, a model of another shape, is held
beside the policy and scores every token. A step with distill.kl_coef c is exactly the step without a
teacher on the advantages A + c (teacher_logp - behav_logp), the teacher's logprobs computed apart by an
engine of the teacher alone; distill/reverse_kl is the mean of behav_logp - teacher_logp over trained
tokens, the same when the teacher is split in two pipeline stages with the policy. A teacher whose
tokenizer gives a token another id is refused before anything is built."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from areal_hpc.arch import model_arch
from areal_hpc.config import PPOConfig, load_config
from areal_hpc.data.initial_model import check_teacher
from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.errors import ConfigError
from areal_hpc.trainer.spawn import run_ranks
from tests.support.compare import max_diff
from tests.support.inputs import random_batch, revealing_optim
from tests.support.shapes import QWEN2, QWEN2_DEEP_UNTIED

VOCAB = model_arch(QWEN2).vocab_size
COEF, TEMPERATURE = 0.5, 0.7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(build_tiny_model(QWEN2, root, seed=5)), str(build_tiny_model(QWEN2_DEEP_UNTIED, root, seed=9))


def _teacher_logprobs(par, teacher, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's logprob of every token of `batch`, in the batch's order, by an engine of its own; and
    the trained tokens' mask."""
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import compute_logprobs, make_microbatch

    everything = make_microbatch(batch, list(range(len(batch.cu_seqlens) - 1)), device=par.device)
    (logp,) = compute_logprobs(Engine(teacher, par, PPOConfig()), [everything], TEMPERATURE)
    return logp.cpu(), everything.loss_mask.cpu()


def _step_rank(par, student, teacher):
    """One step with the teacher, one without it on the advantages the teacher's term gives, one without
    it on the batch's own: their stats and weights."""
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step

    batch = random_batch(VOCAB)
    teacher_logp, mask = _teacher_logprobs(par, teacher, batch)
    shifted = random_batch(VOCAB)
    shifted.advantages = (batch.advantages + COEF * (teacher_logp.numpy() - batch.behav_logprobs)).astype(np.float32)
    out = {"expected_kl": ((batch.behav_logprobs - teacher_logp.numpy()) * mask.numpy()).sum() / mask.sum().item()}
    runs = {
        "teacher": (Engine(student, par, revealing_optim(), teacher=teacher), batch, COEF),
        "shifted": (Engine(student, par, revealing_optim()), shifted, 0.0),
        "plain": (Engine(student, par, revealing_optim()), batch, 0.0),
    }
    for name, (engine, b, coef) in runs.items():
        stats = ppo_step(engine, b, StepConfig(temperature=TEMPERATURE, distill_coef=coef))
        out[name] = {"stats": stats, "weights": {k: v.cpu() for k, v in engine.export_full().items()}}
    return out


def _pp_rank(par, student, teacher):
    from areal_hpc.trainer.engine import Engine
    from areal_hpc.trainer.step import StepConfig, ppo_step

    engine = Engine(student, par, revealing_optim(), teacher=teacher)
    return ppo_step(engine, random_batch(VOCAB), StepConfig(temperature=TEMPERATURE, distill_coef=COEF))


@pytest.mark.megatron
def test_the_teachers_term_is_added_to_each_tokens_advantage(models):
    student, teacher = models
    got = run_ranks(_step_rank, 1, 1, 1, student, teacher)[0]
    with_teacher, shifted, plain = got["teacher"], got["shifted"], got["plain"]
    assert max_diff(with_teacher["weights"], shifted["weights"]) < 1e-6
    assert max_diff(with_teacher["weights"], plain["weights"]) > 1e-3  # the teacher's term moved the weights
    assert with_teacher["stats"]["ppo/loss"] == pytest.approx(shifted["stats"]["ppo/loss"], rel=1e-5)
    kl = with_teacher["stats"]["distill/reverse_kl"]
    assert kl == pytest.approx(got["expected_kl"], rel=1e-5)
    assert with_teacher["stats"]["timing/teacher_s"] > 0
    assert "distill/reverse_kl" not in plain["stats"]


@pytest.mark.megatron
@pytest.mark.slow
def test_a_teacher_split_in_pipeline_stages_gives_the_same_term(models):
    """The teacher split in two pipeline stages with the policy (two layers of its four on each)."""
    student, teacher = models
    whole = run_ranks(_pp_rank, 1, 1, 1, student, teacher)[0]
    split = run_ranks(_pp_rank, 2, 1, 2, student, teacher)
    assert split[0]["distill/reverse_kl"] == pytest.approx(whole["distill/reverse_kl"], rel=1e-5)


def test_a_teacher_with_another_tokenizer_is_refused(models, tmp_path):
    student, teacher = models
    check_teacher(load_config(None, [f"distill.teacher.path={teacher}"]), student)  # the same tokenizer: nothing to say
    other = shutil.copytree(teacher, tmp_path / "other")
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]  # two digits swap ids
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"token '0' is id 3 in the model's and has id 4 in the teacher's \(2 of"):
        check_teacher(load_config(None, [f"distill.teacher.path={other}"]), student)
    (other / "tokenizer.json").unlink()
    (other / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer"):
        check_teacher(load_config(None, [f"distill.teacher.path={other}"]), student)
