"""The episodes' OpenAI endpoint (areal_hpc.workflow.endpoint) with the `openai` package over real HTTP on
loopback, each episode's client driven by a scripted engine (tests.test_workflow_client): the same turns
recorded as the in-process calls record them, streams, keys, refusals, and programs run for an episode."""

import asyncio
import json
import logging
import sys
import textwrap
import time

import httpx
import psutil
import pytest

from areal_hpc.config.schema import RolloutConfig
from areal_hpc.data.tiny import build_tokenizer
from areal_hpc.workflow.builtin import CalculatorAgent, CalculatorAgentHTTP
from areal_hpc.workflow.client import EpisodeClient
from areal_hpc.workflow.endpoint import EpisodeEndpoint
from areal_hpc.workflow.tools import CALCULATOR_SCHEMA
from tests.test_workflow_client import Engine, Tools, client_for, encode, run

pytestmark = pytest.mark.vllm  # vLLM's protocol models check the requests

TURNS = ["<calc>37*48", "\\boxed{1776}"]


def http_client(tok, endpoint, engine, **rollout) -> EpisodeClient:
    """client_for's client on `endpoint`, as EpisodeRunner builds it with rollout.openai_endpoint on."""
    cfg = RolloutConfig(
        **{"max_new_tokens": 16, "tool_format": "tiny", "max_turns": 3, "max_episode_tokens": 64, **rollout}
    )
    return EpisodeClient(tok, cfg, 512, engine, Tools(), endpoint)


async def started() -> EpisodeEndpoint:
    endpoint = EpisodeEndpoint("loopback", "tiny-policy")
    await endpoint.start()
    return endpoint


def api(client):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)


def test_an_agent_over_http_trains_the_same_tokens_as_the_in_process_one():
    """The tiny agent's calculator loop, once through the client and once through `openai.AsyncOpenAI` on the
    endpoint, with the same sampled turns: the same engine calls, trained arrays and counts."""
    tok = build_tokenizer()
    row = {"prompt": "37*48=", "prompt_ids": encode(tok, "37*48=")}
    local_engine, http_engine = Engine(tok, TURNS), Engine(tok, TURNS)
    local = client_for(tok, local_engine, max_turns=3, max_episode_tokens=64)
    run(CalculatorAgent().arun_episode(local, row))

    workflow = CalculatorAgentHTTP()  # kept, with its connection, while the endpoint closes

    async def over_http():
        endpoint = await started()
        client = http_client(tok, endpoint, http_engine)
        try:
            await workflow.arun_episode(client, row)
            assert client.base_url == endpoint.base_url and client.base_url.startswith("http://127.0.0.1:")
        finally:
            client.close()
            began = time.monotonic()
            await endpoint.close()  # the workflow's client keeps its connection open
            assert time.monotonic() - began < 5, "the endpoint waited for an idle keep-alive connection"
        return client

    remote = run(over_http())
    assert http_engine.calls == local_engine.calls and len(local_engine.calls) == 2
    mine, theirs = remote.trajectory_fields(), local.trajectory_fields()
    for name in ("tokens", "seq_lens", "loss_mask", "behav_logprobs", "versions", "answer_ids"):
        assert mine[name].tolist() == theirs[name].tolist(), name
    assert mine["stats"] == theirs["stats"] and mine["stats"]["tool_calls"] == 1
    assert mine["finish_reason"] == theirs["finish_reason"] == "stop"


def test_a_stream_sends_the_turn_a_plain_call_returns():
    tok = build_tokenizer()

    async def both():
        endpoint = await started()
        plain_client, stream_client = (http_client(tok, endpoint, Engine(tok, ["<calc>2+3"])) for _ in range(2))
        messages = [{"role": "user", "content": "2+3="}]
        try:
            async with api(plain_client) as a:
                plain = await a.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA])
            async with api(stream_client) as a:
                stream = await a.chat.completions.create(
                    model="m",
                    messages=messages,
                    tools=[CALCULATOR_SCHEMA],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [chunk async for chunk in stream]
        finally:
            await endpoint.close()
        return plain, chunks, stream_client

    plain, chunks, stream_client = run(both())
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    calls = [call for d in deltas for call in d.tool_calls or []]
    message = plain.choices[0].message
    assert content == (message.content or "") and plain.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert all(c.id.startswith("call_") for c in calls)
    assert json.loads(calls[0].function.arguments) == {"expression": "2+3"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage == plain.usage and chunks[-1].usage.completion_tokens > 0
    assert stream_client.trajectory_fields()["stats"]["turns"] == 1


def test_only_a_running_episodes_key_gets_in_and_bad_requests_touch_nothing(caplog):
    """No key, an unknown one (another rank's), an expired one, a body that is not JSON or not a chat request:
    a 4xx, counted, logged without the key; meanwhile the episode's own calls go on."""
    tok = build_tokenizer()
    caplog.set_level(logging.INFO, "areal_hpc.generator")

    async def requests():
        endpoint, other = await started(), await started()
        engine = Engine(tok, ["\\boxed{5}", "\\boxed{6}"])
        client, ended = http_client(tok, endpoint, engine), http_client(tok, endpoint, Engine(tok, []))
        stranger = http_client(tok, other, Engine(tok, []))
        expired = ended.api_key
        ended.close()
        url = f"{endpoint.base_url}/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "2+3="}]}
        codes = {}
        async with httpx.AsyncClient() as http:
            for name, key in (("no key", None), ("another rank's", stranger.api_key), ("expired", expired)):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                codes[name] = (await http.post(url, json=body, headers=headers)).status_code
            own = {"Authorization": f"Bearer {client.api_key}"}
            codes["not JSON"] = (await http.post(url, content=b"{'messages':", headers=own)).status_code
            codes["not a chat"] = (await http.post(url, json={"messages": "hi"}, headers=own)).status_code
            models = await http.get(f"{endpoint.base_url}/models", headers=own)
            answer = await http.post(url, json=body, headers=own)
            keys = (client.api_key, stranger.api_key, expired)
        await endpoint.close()
        await other.close()
        return codes, models, answer, engine, endpoint, keys

    codes, models, answer, engine, endpoint, keys = run(requests())
    assert codes == {"no key": 401, "another rank's": 401, "expired": 401, "not JSON": 400, "not a chat": 400}
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny-policy"]
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "\\boxed{5}"
    assert len(engine.calls) == 1, "no refused request reached the engine"
    assert dict(endpoint.refused) == {"no key": 1, "unknown or expired key": 2, "not JSON": 1, "not a chat request": 1}
    assert "refused 5 requests" in caplog.text
    assert not any(key in caplog.text for key in keys)


def test_arguments_frameworks_send_are_accepted_and_those_that_change_sampling_named():
    tok = build_tokenizer()

    async def calls():
        from openai import BadRequestError, ConflictError

        endpoint = await started()
        engine, gate = Engine(tok, ["a", "b", "c"]), asyncio.Event()
        gate.set()

        async def gated(token_ids, max_tokens):  # a turn stays in flight while the gate is closed
            await gate.wait()
            return await engine(token_ids, max_tokens)

        client = http_client(tok, endpoint, gated, temperature=1.0)
        messages = [{"role": "user", "content": "q"}]
        errors = {}
        async with api(client) as a:
            for name, extra in (("seed", {"seed": 3}), ("temperature", {"temperature": 0.5})):
                with pytest.raises(BadRequestError) as e:
                    await a.chat.completions.create(model="m", messages=messages, **extra)
                errors[name] = (e.value.status_code, e.value.message)
            sent = dict(parallel_tool_calls=True, stop=[], user="u", temperature=1.0, max_completion_tokens=4)
            sent.update(presence_penalty=0, frequency_penalty=0, response_format={"type": "text"})
            ok = await a.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA], **sent)
            gate.clear()
            first = asyncio.ensure_future(a.chat.completions.create(model="m", messages=messages))
            await asyncio.sleep(0.2)
            with pytest.raises(ConflictError) as e:
                await a.chat.completions.create(model="m", messages=messages)
            gate.set()
            await first
        await endpoint.close()
        return errors, ok, e.value, engine

    errors, ok, conflict, engine = run(calls())
    assert errors["seed"][0] == 400 and "seed: not applied by the rollout engine" in errors["seed"][1]
    assert (
        errors["temperature"][0] == 400
        and "temperature=0.5 differs from rollout.temperature" in errors["temperature"][1]
    )
    assert ok.choices[0].message.content == "a" and engine.calls[0][1] == 4
    assert conflict.status_code == 409 and "one call to the policy at a time" in conflict.message
    assert len(engine.calls) == 2, "the refused calls sampled nothing"


PROGRAM = textwrap.dedent(
    """
    from openai import OpenAI
    api = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY: the episode's
    r = api.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3="}])
    print(r.choices[0].message.content)
    """
)


def test_a_program_with_the_synchronous_client_calls_its_episode():
    tok = build_tokenizer()

    async def episode():
        endpoint = await started()
        engine = Engine(tok, ["\\boxed{5}"])
        client = http_client(tok, endpoint, engine)
        try:
            return await client.run_command([sys.executable, "-c", PROGRAM], time_limit_s=60), client
        finally:
            await endpoint.close()

    result, client = run(episode())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "\\boxed{5}"
    f = client.trajectory_fields()
    assert f["stats"]["turns"] == 1 and tok.decode(f["answer_ids"]) == "\\boxed{5}<|endoftext|>"


def test_a_program_that_exits_ends_with_what_it_left_running_and_a_cancelled_one_too(tmp_path):
    """The program's exit, not the end of its output, ends the call: a child left in the background (holding
    the pipes) is killed with the group; a program whose episode is cancelled (at Stop) is killed too."""
    from areal_hpc.workflow.command import run_command

    pid_file = tmp_path / "child"

    async def programs():
        began = time.monotonic()
        done = await run_command(f"sleep 300 & echo $! > {pid_file}; echo done", 60)
        exited_in = time.monotonic() - began
        background = int(pid_file.read_text())
        script = f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)"
        task = asyncio.ensure_future(run_command([sys.executable, "-c", script], 60))
        while not pid_file.exists() or int(pid_file.read_text() or 0) == background:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return done, exited_in, background, int(pid_file.read_text())

    done, exited_in, background, cancelled_child = run(programs())
    assert (done.returncode, done.stdout) == (0, "done\n") and exited_in < 10
    for pid in (background, cancelled_child):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_program_past_its_limit_is_killed_with_its_children(tmp_path):
    from areal_hpc.workflow.command import run_command

    pid_file = tmp_path / "child"
    script = f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)"

    async def program():
        with pytest.raises(TimeoutError, match="ran past its time limit of 3 s"):
            await run_command([sys.executable, "-c", script], 3)
        done = await run_command("echo out; echo err >&2; exit 3", 10, env={"AREAL_X": "1"})
        return done

    done = run(program())
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_an_address_the_endpoint_cannot_listen_on_is_named(monkeypatch):
    from areal_hpc import network
    from areal_hpc.workflow.endpoint import EndpointError

    monkeypatch.setattr(network, "interface_address", lambda name: "192.0.2.1")  # TEST-NET-1: no host has it
    endpoint = EpisodeEndpoint("cluster", "tiny-policy", interface="eth9")
    with pytest.raises(EndpointError, match=r"rollout.openai_endpoint=cluster: cannot listen on 192.0.2.1 \("):
        run(endpoint.start())


def test_a_thousand_episodes_calling_at_once_all_get_in():
    """As an eval starts its episodes: each agent connects before the loop accepts any connection (the listen
    backlog must hold them; at aiohttp's 128 a third of a thousand calls failed with a connection error)."""
    tok = build_tokenizer()
    row = {"prompt": "2+3=", "prompt_ids": encode(tok, "2+3=")}

    async def episodes():
        endpoint = await started()
        workflow = CalculatorAgentHTTP()
        clients = [http_client(tok, endpoint, Engine(tok, ["\\boxed{5}"])) for _ in range(1000)]
        try:
            return await asyncio.gather(*(workflow.arun_episode(c, row) for c in clients), return_exceptions=True)
        finally:
            await endpoint.close()

    failed = [r for r in run(episodes()) if r is not None]
    assert not failed, f"{len(failed)} of 1000 episodes failed, the first: {failed[0]!r}"
