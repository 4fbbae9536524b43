"""The interruptible vLLM generator against transformers, on a tiny Qwen2 model built here.

One engine serves the whole module (vLLM start costs 15-30 s). Reference logprobs come from
transformers in fp32 with the same weights: `log_softmax(logits / temperature)` at each sampled
token, the convention of `areal_hpc.generator.engine`. Tolerance 1e-3 nats: vLLM's CPU kernels and
transformers' eager attention differ in summation order only (measured: ~5e-7 on the initial
weights, ~7e-5 on the perturbed ones).
"""

import numpy as np
import pytest
import torch

from areal_hpc.config import ModelConfig
from areal_hpc.device import resolve_device
from areal_hpc.protocol import EvalRequest, EvalTrajectory, GenerateRequest, Trajectory
from areal_hpc.testing.generator_runs import (
    drain,
    interrupt_twice,
    interruption_mismatch,
    interruption_problems,
    load,
    perturb,
    reference_logprobs,
)
from areal_hpc.tiny import build_tiny_model

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.8  # != 1: the test tells processed (tempered) logprobs from vLLM's raw default
MAX_NEW = 24
TOL = 1e-3
EOS = 1
MODEL = ModelConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    path = build_tiny_model(MODEL, tmp_path_factory.mktemp("gen"), seed=1)
    engine = create_engine(path)
    model_a = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model_b = perturb(Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), seed=5)
    yield engine, model_a, model_b
    engine.close()


def create_engine(path):
    from areal_hpc.generator.engine import GenerationEngine

    return GenerationEngine.create(
        path,
        device=resolve_device(),
        temperature=TEMPERATURE,
        max_new_tokens=MAX_NEW,
        max_model_len=256,
        max_num_seqs=64,
        seed=0,
    )


def hf_logprobs(model, prompt, output) -> np.ndarray:
    """[T] transformers' fp32 logprobs of `output` at this module's temperature."""
    return reference_logprobs(model, prompt, output, TEMPERATURE)


PROMPTS: dict[int, list[int]] = {}
"""The prompt of each group id this module's engines have generated for (a trajectory does not carry it)."""


def add(engine, group: int, prompt: list[int], n: int) -> None:
    PROMPTS[group] = prompt
    engine.add(GenerateRequest(group, np.asarray(prompt, np.int32), n))


def prompt_of(t) -> list[int]:
    return PROMPTS[t.group_id]


def check_shape(trajs, n_expected):
    assert len(trajs) == n_expected
    assert len({(t.group_id, t.index) for t in trajs}) == n_expected  # each trajectory exactly once
    for t in trajs:
        assert len(t.output_ids) == len(t.behav_logprobs) == len(t.versions) >= 1
        if t.finish_reason == "stop":
            assert t.output_ids[-1] == EOS and len(t.output_ids) <= MAX_NEW
        else:
            assert t.finish_reason == "length" and len(t.output_ids) == MAX_NEW


def test_behav_logprobs_match_transformers(setup):
    engine, model_a, _ = setup
    v = engine.version + 1
    load(engine, model_a, v)
    for g in range(4):
        add(engine, g, [5 + g, 6, 7, 8], n=4)
    trajs = drain(engine)
    check_shape(trajs, 16)
    for t in trajs:
        assert (t.versions == v).all()
        ref = hf_logprobs(model_a, prompt_of(t), t.output_ids)
        np.testing.assert_allclose(t.behav_logprobs, ref, atol=TOL, rtol=0)
    # Not vLLM's raw default: at temperature 0.8 raw logprobs would differ by far more than TOL.
    t = trajs[0]
    ids = torch.tensor([list(prompt_of(t)) + list(t.output_ids)])
    with torch.no_grad():
        raw = torch.log_softmax(model_a(ids).logits[0], -1)[len(prompt_of(t)) - 1 : -1]
    raw = raw.gather(-1, torch.as_tensor(t.output_ids, dtype=torch.long)[:, None])[:, 0].numpy()
    assert np.abs(raw - t.behav_logprobs).max() > 10 * TOL


def test_trajectories_return_as_they_finish(setup):
    engine, _, _ = setup
    add(engine, 100, [9, 10, 11], n=2)
    drain(engine, steps=MAX_NEW // 2)  # the first group is half way
    add(engine, 101, [9, 10, 12], n=2)
    early = []
    while not early:
        early = [t for t in engine.step() if t.group_id == 100]
        assert engine.in_flight or early
    assert engine.in_flight >= 2  # group 100 came back while group 101 is still generating
    drain(engine)


def test_eval_prompts_and_groups_share_the_engine(setup):
    """An eval prompt and a prompt group with the same number and prompt at once: each request gets its own n
    trajectories back, as its own reply (an EvalTrajectory carries no logprobs or versions)."""
    engine, _, _ = setup
    engine.add(EvalRequest(400, np.array([9, 10, 11], np.int32), 3))
    add(engine, 400, [9, 10, 11], n=2)
    replies = drain(engine)
    evals = [t for t in replies if isinstance(t, EvalTrajectory)]
    trajs = [t for t in replies if isinstance(t, Trajectory)]
    assert len(replies) == 5 and sorted((t.prompt_index, t.index) for t in evals) == [(400, i) for i in range(3)]
    check_shape(trajs, 2)
    for t in evals:
        assert t.output_ids.dtype == np.int32 and 1 <= len(t.output_ids) <= MAX_NEW
        assert t.finish_reason == "stop" or len(t.output_ids) == MAX_NEW


def test_interrupt_switches_versions_and_weights(setup):
    """Two updates mid-generation (A -> B -> A): versions switch exactly at each interruption and
    every segment's logprobs match the weights of its version (areal_hpc.testing.generator_runs: the
    GPU check runs the same with many more trajectories in flight, in bf16)."""
    engine, model_a, model_b = setup
    run = interrupt_twice(engine, model_a, model_b, {10 + g: [5 + g, 6, 7] for g in range(4)}, n=4, steps=(8, 5))
    v0, first, second, trajs = run.v0, run.first, run.second, run.trajectories
    assert first and all(1 <= len(p) < MAX_NEW for p in first.values())  # 8 tokens each, unless EOS came first
    assert run.load_s[1] > 0
    check_shape(run.early + trajs, 16)
    switched = 0
    for t in trajs:
        k1, k2 = len(first[(t.group_id, t.index)]), len(second[(t.group_id, t.index)])
        assert list(t.output_ids[:k2]) == second[(t.group_id, t.index)]  # nothing lost or duplicated
        assert list(t.output_ids[:k1]) == first[(t.group_id, t.index)]
        n = len(t.output_ids)
        assert list(t.versions) == [v0] * k1 + [v0 + 1] * (k2 - k1) + [v0 + 2] * (n - k2)  # switch exactly there
        prompt = run.prompts[t.group_id]
        ref_a, ref_b = hf_logprobs(model_a, prompt, t.output_ids), hf_logprobs(model_b, prompt, t.output_ids)
        np.testing.assert_allclose(t.behav_logprobs[:k1], ref_a[:k1], atol=TOL, rtol=0)
        np.testing.assert_allclose(t.behav_logprobs[k1:k2], ref_b[k1:k2], atol=TOL, rtol=0)
        np.testing.assert_allclose(t.behav_logprobs[k2:], ref_a[k2:], atol=TOL, rtol=0)
        switched += k1 < k2 < n
    assert switched >= 1
    mismatch = interruption_mismatch(run, model_a, model_b, TEMPERATURE)
    assert mismatch.before.max < TOL and mismatch.after.max < TOL and mismatch.after.tokens > 0, mismatch
    assert not interruption_problems(run, mismatch, TOL)


def test_loaded_weights_change_outputs(setup):
    engine, model_a, model_b = setup
    v = engine.version + 1
    load(engine, model_b, v)
    add(engine, 200, [20, 21, 22], n=8)
    under_b = drain(engine)
    load(engine, model_a, v + 1)
    add(engine, 201, [20, 21, 22], n=8)
    under_a = drain(engine)
    for trajs, model, other in ((under_b, model_b, model_a), (under_a, model_a, model_b)):
        gaps = []
        for t in trajs:
            np.testing.assert_allclose(
                t.behav_logprobs, hf_logprobs(model, prompt_of(t), t.output_ids), atol=TOL, rtol=0
            )
            gaps.append(np.abs(t.behav_logprobs - hf_logprobs(other, prompt_of(t), t.output_ids)).mean())
        assert np.mean(gaps) > 0.5  # the other weights would have given clearly different logprobs
    # The perturbed weights are peakier: what the engine samples changes with them.
    mean_b = np.mean([t.behav_logprobs.mean() for t in under_b])
    mean_a = np.mean([t.behav_logprobs.mean() for t in under_a])
    assert mean_b > mean_a + 0.5, (mean_a, mean_b)


def test_update_loads_in_place(setup, monkeypatch):
    """An update of the unquantized model bypasses vLLM's layerwise reload: tensors go straight into
    the existing parameters (the embedding keeps its storage), and what vLLM derives from them after
    a load is rebuilt (on CPU: the oneDNN handles of the linear layers and of the tied lm_head), as
    the logprobs under the new weights show."""
    from vllm.model_executor.model_loader.reload import layerwise

    engine, model_a, model_b = setup
    calls = []
    monkeypatch.setattr(layerwise, "_layerwise_process", lambda *a: calls.append(a))

    def embedding(worker):
        weight = worker.model_runner.get_model().model.embed_tokens.weight
        return weight.data_ptr(), weight.detach().clone()

    [(ptr_before, _)] = engine.engine.collective_rpc(embedding)
    v = engine.version + 1
    load(engine, model_b, v)
    [(ptr_after, loaded)] = engine.engine.collective_rpc(embedding)
    assert not calls and ptr_after == ptr_before
    torch.testing.assert_close(loaded, model_b.model.embed_tokens.weight, rtol=0, atol=0)
    add(engine, 300, [30, 31, 32], n=8)
    for t in drain(engine):
        assert (t.versions == v).all()
        np.testing.assert_allclose(t.behav_logprobs, hf_logprobs(model_b, prompt_of(t), t.output_ids), atol=TOL, rtol=0)


def test_settings_are_the_chosen_ones_as_vllm_resolved_them(setup):
    """What the engine runs, read back from its worker: the V1 model runner, no asynchronous scheduling
    (the choices a GPU engine gets too), no CUDA graphs (none on the CPU), the engine core and, at
    gen_tp 1, the worker in this process; and the arguments the generator gave it."""
    from areal_hpc.arch import hf_arch
    from areal_hpc.generator.kv_cache import cpu_kv_cache_bytes

    engine, _, _ = setup
    s = engine.settings()
    kv_bytes = cpu_kv_cache_bytes(hf_arch(engine.engine.vllm_config.model_config.model), 1, 64, 256)
    assert {k: v for k, v in s.items() if k not in ("vllm", "kv_cache_tokens")} == {
        "engine_core": "in-process",
        "model_runner": "V1",
        "worker_start_method": "in-process",
        "async_scheduling": "off",
        "cudagraph_mode": "NONE",
        "compilation_mode": "DYNAMO_TRACE_ONCE",
        "enforce_eager": "off",
        "tensor_parallel_size": "1",
        "dtype": "float32",
        "kv_cache_bytes": str(kv_bytes),
        "prefix_caching": "on",
        "logprobs_mode": "processed_logprobs",
        "max_num_seqs": "64",
        "max_model_len": "256",
    }
    assert int(s["kv_cache_tokens"]) >= 64 * 256  # every trajectory at full length (generator.kv_cache)
    assert s["vllm"].startswith("0.32")


def test_the_environment_is_chosen_over_what_the_user_exported(caplog):
    from areal_hpc.generator.choices import ENVIRONMENT, choose_environment

    env = {"VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_USE_V2_MODEL_RUNNER": "0", "OTHER": "x"}
    with caplog.at_level("WARNING"):
        choose_environment(env)
    assert env == {**ENVIRONMENT, "OTHER": "x"} and ENVIRONMENT["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert [r.getMessage() for r in caplog.records] == [
        "VLLM_WORKER_MULTIPROC_METHOD=fork in the environment: areal-hpc sets spawn (areal_hpc.generator.choices)"
    ]


def test_qwen3_loads_the_trainers_weights(tmp_path):
    """A Qwen3 engine (q/k norms, a head size apart from hidden / heads, tied embeddings) loads weights
    under the names the trainer sends (Hugging Face's, no lm_head.weight when tied), the norms
    included, and samples from them."""
    from transformers import AutoModelForCausalLM

    from areal_hpc.testing.inputs import QWEN3

    path = build_tiny_model(QWEN3, tmp_path, seed=2)
    engine = create_engine(path)
    try:
        model = perturb(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), seed=7)
        named = [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]
        assert any(k.endswith("self_attn.q_norm.weight") for k, _ in named)
        engine.load_weights(named, 1)
        for group in range(2):
            add(engine, group, [5 + group, 6, 7, 8], n=4)
        trajs = drain(engine)
        check_shape(trajs, 8)
        for t in trajs:
            np.testing.assert_allclose(
                t.behav_logprobs, hf_logprobs(model, prompt_of(t), t.output_ids), atol=TOL, rtol=0
            )
    finally:
        engine.close()
