"""The episodes' OpenAI-compatible HTTP endpoint: agent code that takes a `base_url` trains unchanged.

```
 GET  /v1/models             the policy, as one model
 POST /v1/chat/completions   a call of the episode whose key the request carries (Authorization: Bearer KEY):
                             the body (the `openai` package's request, vLLM's ChatCompletionRequest checks
                             its shape) goes to that episode's `client.chat.completions.create`, as a workflow's
                             call would; the answer is the same ChatCompletion, or with `stream` true the same
                             turn sent as chunks (server-sent events) once it is sampled
```

A generator rank runs one (`rollout.openai_endpoint`) on its own event loop, beside its episodes, so a call is
one more awaiting task there: it costs no thread, and the turn it samples is recorded token for token as the
in-process call records it. The loop does not serve requests while the engine takes a step (milliseconds on a
GPU) or loads weights (seconds): a call waits for its turn's tokens, those stalls and any weight load that
interrupts it, which is why the docs ask clients for a long timeout (docs/agents.md).

Keys: each episode gets one (`admit`), unguessable, valid until its episode ends (`revoke`); a request with
no key, another key or a key that expired gets 401, before its body is read, and is counted (`refused`,
logged once per reason and at the end); keys are never logged. Errors have OpenAI's shape: 400 for a body
that is not a chat request or asks what the rollout engine does not do (the message names the argument),
409 for a second call of an episode while one is in flight.

Written with aiohttp's server (a vLLM dependency) rather than vLLM's own server: that one owns an engine and
its event loop; here the engine and the episodes' token records are the rank's.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
from collections import Counter

log = logging.getLogger("areal_hpc.generator")

SETTING = "rollout.openai_endpoint"
SETTINGS = ("loopback", "cluster", "off")
MAX_BODY = 64 << 20
"""Largest request body, in bytes: a long agent conversation with its tool outputs, well past aiohttp's 1 MiB."""
BACKLOG = 4096
"""Connections the kernel holds until the loop accepts them (capped by net.core.somaxconn): an eval starts
thousands of episodes whose agents connect before the loop accepts any; at aiohttp's 128 the kernel reset
a third of a thousand."""
SHUTDOWN_S = 1.0
"""How long `close` waits for open connections (aiohttp's default, 60 s, waits for every agent's keep-alive
connection, past the controller's limit on a rank's stop); the episodes are cancelled by then."""


class EndpointError(RuntimeError):
    """The endpoint could not listen where `rollout.openai_endpoint` says."""


class EpisodeEndpoint:
    """The HTTP endpoint of one generator rank. `where`: `rollout.openai_endpoint` (loopback: 127.0.0.1;
    cluster: `interface`'s address when set, else every interface, announced by the host's name);
    `model`: the name /v1/models lists."""

    def __init__(self, where: str, model: str, interface: str = ""):
        if where not in SETTINGS[:2]:
            raise ValueError(f"{SETTING} must be one of {', '.join(SETTINGS)} to listen, got {where!r}")
        self.where, self.model, self.interface = where, model, interface
        self.base_url = ""
        self.refused: Counter[str] = Counter()
        self._clients: dict[str, object] = {}  # key -> the episode's EpisodeClient
        self._runner = None
        self._closing = False

    async def start(self) -> str:
        """Listen on a port the OS chooses; returns the base URL (`http://host:port/v1`)."""
        from aiohttp import web

        from areal_hpc.network import interface_address

        _raise_open_files()
        bind, announced = "127.0.0.1", "127.0.0.1"
        if self.where == "cluster":
            bind = interface_address(self.interface) if self.interface else "0.0.0.0"
            announced = bind if self.interface else socket.gethostname()
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_S, handler_cancellation=True
        )  # a caller that hangs up (a program killed at its limit, a client's timeout) ends its call
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, bind, 0, backlog=BACKLOG).start()
        except OSError as e:
            await self._runner.cleanup()
            raise EndpointError(f"{SETTING}={self.where}: cannot listen on {bind} ({e})") from e
        port = self._runner.addresses[0][1]
        self.base_url = f"http://{announced}:{port}/v1"
        return self.base_url

    async def close(self) -> None:
        self._closing = True  # the episodes were cancelled: their last requests are refused, not counted
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.refused:
            log.info("OpenAI endpoint: refused %d requests (%s)", self.refused.total(), _counts(self.refused))

    def admit(self, client) -> str:
        """A new key for `client`'s episode."""
        key = f"areal-{secrets.token_urlsafe(32)}"
        self._clients[key] = client
        return key

    def revoke(self, key: str) -> None:
        self._clients.pop(key, None)

    # --- requests ---
    def _caller(self, request):
        """The episode client the request's key names, or None (refused, counted)."""
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        client = self._clients.get(key.strip()) if scheme.lower() == "bearer" else None
        if client is None:
            self._refuse("no key" if not key else "unknown or expired key", request)
        return client

    def _refuse(self, reason: str, request) -> None:
        if self._closing:
            return
        if not self.refused[reason]:
            log.warning(
                "OpenAI endpoint: refused %s %s from %s: %s (later ones are counted)",
                request.method, request.path, request.remote, reason,
            )  # fmt: skip
        self.refused[reason] += 1

    async def _models(self, request):
        from aiohttp import web
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        if self._caller(request) is None:
            return _error(401, "unauthorized: the episode's key (client.api_key) is required")
        return web.json_response(
            text=ModelList(data=[ModelCard(id=self.model, owned_by="areal-hpc")]).model_dump_json()
        )

    async def _chat(self, request):
        from jinja2 import TemplateError
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        from areal_hpc.workflow.client import CallInFlight

        client = self._caller(request)
        if client is None:
            return _error(401, "unauthorized: a call needs its episode's key (client.api_key), valid while it runs")
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self._refuse("not JSON", request)
            return _error(400, f"the body is not JSON ({e})")
        if not isinstance(body, dict):
            self._refuse("not a JSON object", request)
            return _error(400, f"the body must be a JSON object, got {type(body).__name__}")
        stream, options = body.pop("stream", False), body.pop("stream_options", None)
        if not isinstance(stream, bool) or not isinstance(options, dict | None):
            self._refuse("not a chat request", request)
            return _error(400, f"stream must be a boolean and stream_options an object, got {stream!r}, {options!r}")
        usage = bool((options or {}).get("include_usage"))
        known = {k: v for k, v in body.items() if k in ChatCompletionRequest.model_fields}  # the rest: the client's
        try:  # the shape only: what is called is the body as sent (tools are rendered in their keys' order)
            ChatCompletionRequest.model_validate(known)
        except (ValidationError, ValueError) as e:
            self._refuse("not a chat request", request)
            return _error(400, f"not a chat completion request: {e}")
        try:
            completion = await client.chat.completions.create(**body)
        except CallInFlight as e:
            return _error(409, str(e))
        except (ValueError, TemplateError) as e:  # the call's arguments, or messages its chat template refuses
            return _error(400, f"{type(e).__name__}: {e}" if isinstance(e, TemplateError) else str(e))
        except Exception as e:
            log.exception("OpenAI endpoint: a call failed")
            return _error(500, f"the call failed inside the generator: {type(e).__name__}: {e}")
        if not stream:
            from aiohttp import web

            return web.json_response(text=completion.model_dump_json())
        return await _stream(request, completion, usage)


async def _stream(request, completion, usage: bool):
    """`completion` as OpenAI's chunks: the role and content, the tool calls, the finish reason, the usage
    when asked (`stream_options.include_usage`), then `[DONE]`."""
    from aiohttp import web
    from openai.types.chat import ChatCompletionChunk

    choice = completion.choices[0]
    message = choice.message
    calls = [
        {"index": i, "id": c.id, "type": "function", "function": c.function.model_dump()}
        for i, c in enumerate(message.tool_calls or [])
    ]
    deltas = [({"role": "assistant", "content": message.content or ""}, None)]
    if calls:
        deltas.append(({"tool_calls": calls}, None))
    deltas.append(({}, choice.finish_reason))
    head = {"id": completion.id, "object": "chat.completion.chunk", "created": completion.created}
    chunks = [
        ChatCompletionChunk(**head, model=completion.model, choices=[{"index": 0, "delta": d, "finish_reason": f}])
        for d, f in deltas
    ]
    if usage:
        chunks.append(ChatCompletionChunk(**head, model=completion.model, choices=[], usage=completion.usage))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {chunk.model_dump_json()}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(status: int, message: str):
    from aiohttp import web
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    kind = {400: "BadRequestError", 401: "AuthenticationError", 409: "ConflictError", 500: "InternalServerError"}[
        status
    ]
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status))
    return web.json_response(text=body.model_dump_json(), status=status)


def _raise_open_files() -> None:
    """Raise this process's limit on open files to its hard limit (vLLM's `set_ulimit`, which its server
    calls): every episode's call holds a connection (two descriptors when the agent runs in the rank), and
    clusters often set 1,024."""
    import resource

    from vllm.utils.system_utils import set_ulimit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < target:
        set_ulimit(target)
        log.info("OpenAI endpoint: open files limit raised from %d to %d (the hard limit)", soft, target)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in counter.most_common())
