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

from areal_hpc.data.tiny import build_tiny_model
from areal_hpc.device import resolve_device
from tests.support.generator_runs import (
    drain,
    interrupt_twice,
    interruption_mismatch,
    interruption_problems,
    load,
    perturb,
    reference_logprobs,
)
from tests.support.shapes import GENERATOR, QWEN3

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.8  # != 1: the test tells processed (tempered) logprobs from vLLM's raw default
MAX_NEW = 24
TOL = 1e-3
EOS = 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    path = build_tiny_model(GENERATOR, tmp_path_factory.mktemp("gen"), seed=1)
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
        max_model_len=256,
        max_num_seqs=64,
        seed=0,
    )


def hf_logprobs(model, prompt, output) -> np.ndarray:
    """[T] transformers' fp32 logprobs of `output` at this module's temperature."""
    return reference_logprobs(model, prompt, output, TEMPERATURE)


def add(engine, group: int, prompt: list[int], n: int, max_tokens: int = MAX_NEW) -> None:
    """`n` turns after `prompt`, keys `g{group}.{i}`."""
    for i in range(n):
        engine.submit(f"g{group}.{i}", prompt, max_tokens)


def group_of(t) -> int:
    return int(t.key.split(".")[0][1:])


def check_shape(turns, n_expected, max_tokens=MAX_NEW):
    assert len(turns) == n_expected
    assert len({t.key for t in turns}) == n_expected  # each turn exactly once
    for t in turns:
        assert len(t.sampled.token_ids) == len(t.sampled.behav_logprobs) == len(t.sampled.versions) >= 1
        if t.sampled.finish_reason == "stop":
            assert t.sampled.token_ids[-1] == EOS and len(t.sampled.token_ids) <= max_tokens
        else:
            assert t.sampled.finish_reason == "length" and len(t.sampled.token_ids) == max_tokens


def test_behav_logprobs_match_transformers(setup):
    engine, model_a, _ = setup
    v = engine.version + 1
    load(engine, model_a, v)
    for g in range(4):
        add(engine, g, [5 + g, 6, 7, 8], n=4)
    turns = drain(engine)
    check_shape(turns, 16)
    for t in turns:
        assert set(t.sampled.versions) == {v}
        ref = hf_logprobs(model_a, t.context_ids, t.sampled.token_ids)
        np.testing.assert_allclose(t.sampled.behav_logprobs, ref, atol=TOL, rtol=0)
    # Not vLLM's raw default: at temperature 0.8 raw logprobs would differ by far more than TOL.
    t = turns[0]
    ids = torch.tensor([list(t.context_ids) + list(t.sampled.token_ids)])
    with torch.no_grad():
        raw = torch.log_softmax(model_a(ids).logits[0], -1)[len(t.context_ids) - 1 : -1]
    raw = raw.gather(-1, torch.as_tensor(t.sampled.token_ids, dtype=torch.long)[:, None])[:, 0].numpy()
    assert np.abs(raw - t.sampled.behav_logprobs).max() > 10 * TOL


def test_turns_return_as_they_finish(setup):
    engine, _, _ = setup
    add(engine, 100, [9, 10, 11], n=2)
    drain(engine, steps=MAX_NEW // 2)  # the first turns are half way
    add(engine, 101, [9, 10, 12], n=2)
    early = []
    while not early:
        early = [t for t in engine.step() if group_of(t) == 100]
        assert engine.in_flight or early
    assert engine.in_flight >= 2  # group 100's turns came back while group 101's are still sampling
    drain(engine)


def test_each_turn_keeps_its_own_budget_across_an_interruption(setup):
    """Turns of different `max_tokens` side by side, interrupted by a weight update: each resumes with
    what is left of its own budget, so none samples more than it was given."""
    engine, model_a, _ = setup
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        engine.submit("none", [9, 10], 0)
    add(engine, 500, [9, 10, 13], n=3, max_tokens=6)
    add(engine, 501, [9, 10, 13], n=3, max_tokens=MAX_NEW)
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit("g500.0", [9], 4)
    turns = drain(engine, steps=3)
    assert [t.key for t in engine.partial() if len(t.sampled.token_ids) == 3]  # the update catches turns mid-way
    v = engine.version + 1
    load(engine, model_a, v)
    turns += drain(engine)
    check_shape([t for t in turns if group_of(t) == 500], 3, max_tokens=6)
    check_shape([t for t in turns if group_of(t) == 501], 3, max_tokens=MAX_NEW)
    assert any(t.attempt == 1 and t.sampled.versions[-1] == v for t in turns)


def test_interrupt_switches_versions_and_weights(setup):
    """Two updates mid-generation (A -> B -> A): versions switch exactly at each interruption and
    every segment's logprobs match the weights of its version (tests.support.generator_runs: the
    GPU check runs the same with many more turns in flight, in bf16)."""
    engine, model_a, model_b = setup
    run = interrupt_twice(engine, model_a, model_b, [[5 + g, 6, 7] for g in range(4)], 4, MAX_NEW, steps=(8, 5))
    v0, first, second, turns = run.v0, run.first, run.second, run.turns
    assert first and all(1 <= len(p) < MAX_NEW for p in first.values())  # 8 tokens each, unless EOS came first
    assert run.load_s[1] > 0
    check_shape(run.early + turns, 16)
    switched = 0
    for t in turns:
        k1, k2 = len(first[t.key]), len(second[t.key])
        assert t.sampled.token_ids[:k2] == second[t.key]  # nothing lost or duplicated
        assert t.sampled.token_ids[:k1] == first[t.key]
        n = len(t.sampled.token_ids)
        assert t.sampled.versions == [v0] * k1 + [v0 + 1] * (k2 - k1) + [v0 + 2] * (n - k2)  # switch exactly there
        prompt = t.context_ids
        ref_a, ref_b = (
            hf_logprobs(model_a, prompt, t.sampled.token_ids),
            hf_logprobs(model_b, prompt, t.sampled.token_ids),
        )
        np.testing.assert_allclose(t.sampled.behav_logprobs[:k1], ref_a[:k1], atol=TOL, rtol=0)
        np.testing.assert_allclose(t.sampled.behav_logprobs[k1:k2], ref_b[k1:k2], atol=TOL, rtol=0)
        np.testing.assert_allclose(t.sampled.behav_logprobs[k2:], ref_a[k2:], atol=TOL, rtol=0)
        switched += k1 < k2 < n
    assert switched >= 1
    mismatch = interruption_mismatch(run, model_a, model_b, TEMPERATURE)
    assert mismatch.before.max < TOL and mismatch.after.max < TOL and mismatch.after.tokens > 0, mismatch
    assert not interruption_problems(run, mismatch, TOL)


def test_without_interruption_turns_finish_on_one_version(setup):
    """The engine's part of rollout.interruptible false: after `hold` the turns running finish under the
    old weights (none aborted: one attempt, one version), the turns submitted meanwhile wait outside vLLM
    and start under the new weights once they load."""
    engine, model_a, model_b = setup
    v = engine.version + 1
    load(engine, model_a, v)
    add(engine, 600, [5, 6, 7, 8], n=8)
    finished = drain(engine, steps=4)
    caught = [t for t in engine.partial() if t.sampled.token_ids]
    assert caught  # the hold catches turns mid-way
    engine.hold()
    add(engine, 601, [5, 6, 7, 9], n=4)
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit("g601.0", [9], 4)
    assert engine.in_flight == engine.running + 4 == 8 - len(finished) + 4
    while engine.running:
        finished += engine.step()
    assert engine.in_flight == 4 and [t.sampled.token_ids for t in engine.partial()] == [[]] * 4  # none started
    load(engine, model_b, v + 1)
    assert engine.running == 4
    later = drain(engine)
    check_shape(finished, 8)
    check_shape(later, 4)
    assert {group_of(t) for t in later} == {601}
    for turns, version, model in ((finished, v, model_a), (later, v + 1, model_b)):
        for t in turns:
            assert t.attempt == 0 and t.sampled.versions == [version] * len(t.sampled.token_ids)
            np.testing.assert_allclose(
                t.sampled.behav_logprobs, hf_logprobs(model, t.context_ids, t.sampled.token_ids), atol=TOL, rtol=0
            )
    by_key = {t.key: t for t in finished}
    assert any(
        len(by_key[t.key].sampled.token_ids) > len(t.sampled.token_ids) for t in caught
    )  # they went on past the hold


def test_loaded_weights_change_outputs(setup):
    engine, model_a, model_b = setup
    v = engine.version + 1
    load(engine, model_b, v)
    add(engine, 200, [20, 21, 22], n=8)
    under_b = drain(engine)
    load(engine, model_a, v + 1)
    add(engine, 201, [20, 21, 22], n=8)
    under_a = drain(engine)
    for turns, model, other in ((under_b, model_b, model_a), (under_a, model_a, model_b)):
        gaps = []
        for t in turns:
            np.testing.assert_allclose(
                t.sampled.behav_logprobs, hf_logprobs(model, t.context_ids, t.sampled.token_ids), atol=TOL, rtol=0
            )
            gaps.append(
                np.abs(t.sampled.behav_logprobs - hf_logprobs(other, t.context_ids, t.sampled.token_ids)).mean()
            )
        assert np.mean(gaps) > 0.5  # the other weights would have given clearly different logprobs
    # The perturbed weights are peakier: what the engine samples changes with them.
    mean_b = np.mean([np.mean(t.sampled.behav_logprobs) for t in under_b])
    mean_a = np.mean([np.mean(t.sampled.behav_logprobs) for t in under_a])
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
        assert set(t.sampled.versions) == {v}
        np.testing.assert_allclose(
            t.sampled.behav_logprobs, hf_logprobs(model_b, t.context_ids, t.sampled.token_ids), atol=TOL, rtol=0
        )


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
        "aot_compile": "off",
        "enforce_eager": "off",
        "tensor_parallel_size": "1",
        "dtype": "float32",
        "kv_cache_bytes": str(kv_bytes),
        "prefix_caching": "on",
        "logprobs_mode": "processed_logprobs",
        "max_num_seqs": "64",
        "max_num_batched_tokens": str(64 * 256),  # the project's (choices.step_tokens), not vLLM's 2,048
        "max_model_len": "256",
        "lora": "off",
    }
    assert int(s["kv_cache_tokens"]) >= 64 * 256  # every trajectory at full length (generator.kv_cache)
    assert s["vllm"].startswith("0.32")


def test_an_engine_step_holds_every_decode_token_and_a_prefill_chunk():
    from areal_hpc.generator.choices import PREFILL_CHUNK_TOKENS, step_tokens

    assert step_tokens(1024, 32768) == 1024 + PREFILL_CHUNK_TOKENS == 17408  # qwen1.5b's engines
    assert step_tokens(4, 256) == 4 * 256  # no more than every trajectory at full length


def test_a_gpu_engine_gets_the_projects_memory_share_and_step_budget(tmp_path):
    """What a GPU generator's engine is built with, read from its arguments (vLLM's CUDA engine cannot start
    here): vLLM's share from the project's budget (generator.memory), the step budget, and with routing
    recorded eager decode (the router hook is installed after vLLM would capture its CUDA graphs)."""
    from areal_hpc.config import load_config
    from areal_hpc.generator.choices import step_tokens
    from areal_hpc.generator.engine import GenerationEngine
    from areal_hpc.generator.memory import GeneratorMemory

    path = build_tiny_model(GENERATOR, tmp_path, seed=1)
    share = GeneratorMemory.of(load_config(None, []), 80e9).utilization
    args = GenerationEngine.engine_args(path, device="cuda", max_num_seqs=8, gpu_memory_utilization=share)
    assert args.gpu_memory_utilization == share < 0.92 and args.kv_cache_memory_bytes is None
    assert args.max_num_batched_tokens == step_tokens(8, GENERATOR.max_position_embeddings)
    assert not args.enforce_eager
    assert GenerationEngine.engine_args(path, device="cuda", record_routing=True).enforce_eager


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

    path = build_tiny_model(QWEN3, tmp_path, seed=2)
    engine = create_engine(path)
    try:
        model = perturb(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), seed=7)
        named = [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"]
        assert any(k.endswith("self_attn.q_norm.weight") for k, _ in named)
        engine.load_weights(named, 1)
        for group in range(2):
            add(engine, group, [5 + group, 6, 7, 8], n=4)
        turns = drain(engine)
        check_shape(turns, 8)
        for t in turns:
            np.testing.assert_allclose(
                t.sampled.behav_logprobs, hf_logprobs(model, t.context_ids, t.sampled.token_ids), atol=TOL, rtol=0
            )
    finally:
        engine.close()
