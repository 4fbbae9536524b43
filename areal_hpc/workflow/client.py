"""The client an episode's workflow talks to (`EpisodeClient`): it turns the workflow's calls into engine
turns, keeps the episode's token record (areal_hpc.workflow.conversation), applies the episode's limits
and counts what the episode did. What a workflow may call and what each call does is the contract in
`areal_hpc.workflow.Workflow`'s docstring; this module implements it:

    client.chat.completions.create(messages=..., tools=...)   OpenAI-style, tool calls parsed, + token_ids
    client.generate(context_ids, max_tokens)                 token level: the workflow builds the tokens
    client.run_tool(name, arguments)                         a tool call through the system's tool pool
    client.base_url, client.api_key                          the same chat call over HTTP (workflow.endpoint)
    client.run_command(args, time_limit_s)                   a program with those two in its environment

A call past a limit returns an empty "length" turn instead of raising, so user code that catches
exceptions cannot loop on it; arguments that would change what is sampled raise, naming the argument,
since the trainer recomputes logprobs at the run's settings. The OpenAI types are built here, in the
episode's event loop next to the engine: the turn's tokens are recorded as sampled, never re-tokenized.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import time
import uuid
from dataclasses import dataclass

import numpy as np

from areal_hpc.protocol import EPISODE_STATS
from areal_hpc.workflow.conversation import Conversation, EpisodeTokens
from areal_hpc.workflow.tool_calls import parse_tool_calls


@dataclass
class Turn:
    """One sampled turn, as the engine returns it."""

    token_ids: list[int]  # incl. the stop token when it stopped
    behav_logprobs: list[float]  # per token, under the weights that sampled it
    versions: list[int]  # per token, the policy version that sampled it
    finish_reason: str  # "stop" | "length"
    routing: np.ndarray | None = None  # [context + output, L, K] when the engine records it (ppo.routing_replay)


ACCEPTED = frozenset(
    ("messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n")
    + ("model", "parallel_tool_calls", "stream_options", "user", "metadata", "store", "chat_template_kwargs")
)
"""The chat call's arguments: those it applies (the first line; `temperature`, `top_p`, `n` and `tool_choice`
only at the run's values) and those that agent frameworks send without changing what is sampled (ignored).
Any other argument given a value (not None, False, empty, or its NEUTRAL value) is refused with its name: it would change what is
sampled or how it comes back (`stop`, `seed`, `response_format`, `logit_bias`, ...)."""

CLIENT_OPTIONS = ("extra_body", "extra_headers", "extra_query", "timeout")
"""The `openai` client's own arguments: `extra_body` is merged into the call as it is on the wire, the rest
concern HTTP and are ignored."""


class CallInFlight(RuntimeError):
    """A second call to the policy while one of the same episode is in flight (HTTP: 409)."""


class EpisodeClient:
    """One episode's client. `sample(token_ids, max_tokens) -> Turn` (async) runs one turn on the engine;
    `tool(name, arguments) -> (text, ok, seconds)` (async) runs one tool call and never raises for the
    tool's failure. Both are the generator's (areal_hpc.generator.episodes)."""

    def __init__(self, tokenizer, rollout, max_model_len: int, sample, tool, endpoint=None):
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.max_model_len = max_model_len
        self.max_episode_tokens = rollout.max_episode_tokens or max_model_len
        self.chat = _Chat(self)
        self.episode = EpisodeTokens()
        self.conversation: Conversation | None = None  # built at the first chat call (its template kwargs)
        self._sample = sample
        self._tool = tool
        self._endpoint = endpoint  # the rank's EpisodeEndpoint (areal_hpc.workflow.endpoint), None when off
        self._key: str | None = None  # this episode's key on it, made at the first use; "" once the episode ended
        self._limited = False  # a call was refused by a limit: the episode ends as "length"
        self._calling = False  # a call to the policy is in flight
        self._last_finish = "stop"
        self.turns = 0
        self.resumed_tokens = 0  # sampled before a checkpoint this episode resumed from (set by its generator)
        self.tool_calls = 0
        self.tool_errors = 0
        self.tool_s = 0.0

    async def generate(self, context_ids, max_tokens: int | None = None) -> Turn:
        """Sample one turn after `context_ids`. They continue the episode's current sequence when they
        extend it (the new ids are context), otherwise they start a new sequence. Past a limit: an empty
        "length" turn."""
        with self._one_call():
            _check_max_tokens(max_tokens)
            if self._out_of_turns():
                return Turn([], [], [], "length")
            context = self.episode.extend_to([int(t) for t in context_ids])
            turn = await self._turn(context, max_tokens)
            if turn is None:
                return Turn([], [], [], "length")
            self.episode.add_sampled(turn.token_ids, turn.behav_logprobs, turn.versions, turn.routing)
            return turn

    async def run_tool(self, name: str, arguments) -> str:
        """The text the model reads next for a call of tool `name` with `arguments` (a dict, or the JSON
        string of a parsed tool call): the tool's output (cut to `rollout.tool_output_chars` by the tool
        pool), or "error: ..." when the arguments are not a JSON object or the tool failed or timed out
        (counted in `tool_errors`)."""
        self.tool_calls += 1
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
        else:
            parsed = arguments
        if not isinstance(parsed, dict):
            self.tool_errors += 1
            return f"error: the arguments of {name} must be a JSON object, got {str(arguments)[:100]!r}"
        text, ok, seconds = await self._tool(name, parsed)
        self.tool_s += seconds
        self.tool_errors += not ok
        return text

    @property
    def base_url(self) -> str:
        """The rank's OpenAI-compatible endpoint (`http://host:port/v1`): with `api_key`, an `openai` client
        (or any framework's) whose calls are this episode's chat calls."""
        return self._http()[0]

    @property
    def api_key(self) -> str:
        """This episode's key on the endpoint, valid until the episode ends."""
        return self._http()[1]

    async def run_command(self, args, time_limit_s: float, **options):
        """Run the program `args` for this episode, with OPENAI_BASE_URL and OPENAI_API_KEY set to the
        episode's; its CommandResult (exit status, output), or TimeoutError past `time_limit_s` (the process
        group killed). `options`: areal_hpc.workflow.command.run_command's."""
        from areal_hpc.workflow.command import run_command

        env = {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, **(options.pop("env", None) or {})}
        return await run_command(args, time_limit_s, env=env, **options)

    def close(self) -> None:
        """The episode ended: its key no longer opens the endpoint."""
        if self._key:
            self._endpoint.revoke(self._key)
        self._key = ""

    def _http(self) -> tuple[str, str]:
        if self._endpoint is None:
            raise RuntimeError(
                "this episode has no HTTP endpoint: rollout.openai_endpoint is off (set loopback, or cluster for "
                "agents on other hosts)"
            )
        if self._key == "":
            raise RuntimeError("the episode has ended: its endpoint key is no longer valid")
        if self._key is None:
            self._key = self._endpoint.admit(self)
        return self._endpoint.base_url, self._key

    def trajectory_fields(self) -> dict:
        """What a reply (`protocol.Trajectory`) carries of the episode: `tokens`, `seq_lens`, `loss_mask`,
        `behav_logprobs`, `versions`, `answer_ids`, `routing` (EpisodeTokens.arrays), `finish_reason` ("length"
        when a limit refused a call or the last sampled turn was cut, else "stop") and `stats`
        (protocol.EPISODE_STATS)."""
        rewrites = self.conversation.rewrites if self.conversation else 0
        counts = {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_s": self.tool_s,
            "template_rewrites": rewrites,
            "resumed_tokens": self.resumed_tokens,
        }
        return {
            **self.episode.arrays(),
            "finish_reason": "length" if self._limited else self._last_finish,
            "stats": {k: counts[k] for k in EPISODE_STATS},
        }

    # --- the chat call (client.chat.completions.create) ---

    async def _create(self, **kwargs):
        with self._one_call():
            args = {k: v for k, v in kwargs.items() if k not in CLIENT_OPTIONS}
            args.update(kwargs.get("extra_body") or {})
            self._check_arguments(args)
            messages, tools = args.get("messages"), args.get("tools")
            if messages is None:
                raise ValueError("messages is missing: a chat call needs the conversation's messages")
            tool_choice = args.get("tool_choice") or "auto"
            max_tokens = args.get("max_completion_tokens")
            max_tokens = args.get("max_tokens") if max_tokens is None else max_tokens
            _check_max_tokens(max_tokens)
            model = args.get("model")
            conversation = self._conversation(args.get("chat_template_kwargs") or {})
            if self._out_of_turns():
                return self._completion(model, _message(""), "length", 0, [])
            context = conversation.prompt_ids(messages, tools)
            turn = await self._turn(context, max_tokens)
            if turn is None:
                return self._completion(model, _message(""), "length", len(context), [])
            ids = list(turn.token_ids)
            text = self.tokenizer.decode(_strip_turn_end(ids, conversation), skip_special_tokens=False)
            content, calls = text, []
            if tools and tool_choice != "none":  # as vLLM's server: parse only when the request has tools
                content, calls = parse_tool_calls(self.rollout.tool_format, self.tokenizer, text)
            message = _message(content, calls)
            conversation.add_turn(ids, turn.behav_logprobs, turn.versions, message, turn.routing)
            finish = "tool_calls" if calls else turn.finish_reason
            return self._completion(model, message, finish, len(context), ids)

    def _conversation(self, template_kwargs: dict) -> Conversation:
        if self.conversation is None:
            self.conversation = Conversation(self.tokenizer, self.episode, template_kwargs=template_kwargs)
        elif dict(template_kwargs) != self.conversation.template_kwargs:
            raise ValueError(
                f"extra_body['chat_template_kwargs'] must stay the same within an episode: the first call had "
                f"{self.conversation.template_kwargs}, this one {template_kwargs}"
            )
        return self.conversation

    def _check_arguments(self, args: dict) -> None:
        r = self.rollout
        for name, run in (("temperature", r.temperature), ("top_p", r.top_p)):
            if args.get(name) is not None and args[name] != run:
                raise ValueError(
                    f"{name}={args[name]} differs from rollout.{name} ({run}): the trainer computes the sampled "
                    f"tokens' logprobs at rollout.{name}; leave {name} unset in the call, or change rollout.{name}"
                )
        if args.get("n") not in (None, 1):
            raise ValueError(
                f"n={args['n']}: an episode samples one answer per call (the group's episodes are the n samples, "
                "rollout.group_size); leave n unset"
            )
        if args.get("tool_choice") not in (None, "auto", "none"):
            raise ValueError(
                f"tool_choice={args['tool_choice']!r}: the rollout engine does not force tool calls; leave "
                'tool_choice unset ("auto") or "none", and let the prompt ask for the call'
            )
        if args.get("stream"):
            raise ValueError(
                "stream=True: this client answers each turn whole; leave stream unset (the HTTP endpoint, "
                "client.base_url, answers a stream)"
            )
        refused = sorted(k for k, v in args.items() if k not in ACCEPTED and not _unset(k, v))
        if refused:
            raise ValueError(
                f"{', '.join(refused)}: not applied by the rollout engine, which samples every turn as the run's "
                "rollout settings say (what it would change is not what the trainer scores); leave them unset"
            )

    # --- shared by both calls ---

    @contextlib.contextmanager
    def _one_call(self):
        """Refuses a call while another is in flight: both would extend the same sequence (and the
        conversation's pending call), interleaving two turns into one record."""
        if self._calling:
            raise CallInFlight(
                "one call to the policy at a time per episode (generate or chat.completions.create): await "
                "each before the next; sample in parallel as separate episodes (rollout.group_size)"
            )
        self._calling = True
        try:
            yield
        finally:
            self._calling = False

    def _out_of_turns(self) -> bool:
        """`rollout.max_turns` reached: the call is refused and the episode ends as "length"."""
        out = self.turns >= self.rollout.max_turns
        self._limited |= out
        return out

    async def _turn(self, context: list[int], max_tokens: int | None) -> Turn | None:
        """The engine's turn after `context` (the episode's current sequence), or None when no token fits
        (`max_tokens` capped by rollout.max_new_tokens, the episode's tokens, the model's context)."""
        budget = min(
            max_tokens or self.rollout.max_new_tokens,
            self.rollout.max_new_tokens,
            self.max_episode_tokens - self.episode.num_tokens,
            self.max_model_len - len(context),
        )
        if budget <= 0:
            self._limited = True
            return None
        turn = await self._sample(list(context), budget)
        self.turns += 1
        self._last_finish = turn.finish_reason
        return turn

    def _completion(self, model, message, finish_reason: str, prompt_tokens: int, token_ids: list[int]):
        from openai.types.chat import ChatCompletion
        from openai.types.chat.chat_completion import Choice
        from openai.types.completion_usage import CompletionUsage

        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            object="chat.completion",
            created=int(time.time()),
            model=model or served_model(self.tokenizer),
            choices=[Choice(index=0, message=message, finish_reason=finish_reason)],
            usage=CompletionUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=len(token_ids),
                total_tokens=prompt_tokens + len(token_ids),
            ),
            token_ids=token_ids,  # the sampled ids (an extra field: openai's models allow them)
        )


class _Completions:
    """`client.chat.completions`, as on openai.AsyncOpenAI."""

    def __init__(self, client: EpisodeClient):
        self._client = client

    async def create(self, **kwargs):
        """An OpenAI-style chat completion (openai.types.chat.ChatCompletion) for one sampled turn; see
        areal_hpc.workflow.client for what it does with the messages and the limits."""
        return await self._client._create(**kwargs)


class _Chat:
    def __init__(self, client: EpisodeClient):
        self.completions = _Completions(client)


def served_model(tokenizer) -> str:
    """The policy's name in answers and on the endpoint's /v1/models: its model directory."""
    return tokenizer.name_or_path or "policy"


def _message(content: str | None, tool_calls=None):
    from openai.types.chat import ChatCompletionMessage

    return ChatCompletionMessage(role="assistant", content=content, tool_calls=tool_calls or None)


def _strip_turn_end(ids: list[int], conversation: Conversation) -> list[int]:
    """The turn's ids without the token that ended it (the parsers read the text before it)."""
    ends = {conversation.turn_end_id, conversation.tokenizer.eos_token_id}
    return ids[:-1] if ids and ids[-1] in ends else ids


NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "top_logprobs": 0,
    "response_format": {"type": "text"},
}
"""Values of refused arguments that change nothing, which some frameworks send on every call."""


def _unset(name: str, value) -> bool:
    """An argument sent with no effect: None, False, empty (`stop: []`, `logit_bias: {}`) or NEUTRAL's."""
    if value is None or value is False or (isinstance(value, (str, list, tuple, dict)) and not value):
        return True
    return name in NEUTRAL and value == NEUTRAL[name]


def _check_max_tokens(max_tokens) -> None:
    if max_tokens is not None and (not isinstance(max_tokens, numbers.Integral) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive integer or None (rollout.max_new_tokens), got {max_tokens!r}")
