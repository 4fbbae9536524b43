"""Token-in-token-out: an episode's tokens are exactly the tokens the engine saw, built turn by turn.

An episode is one or more sequences (`EpisodeTokens`). Each holds per token its id, `loss_mask` (1
exactly on sampled tokens), `behav_logprobs` (each sampled token's logprob under the weights that
sampled it; 0 on context) and `versions` (the policy version that sampled it; -1 on context: the
prompt, tool and user messages, template glue); with routing replay also `routing`, [n, L, K]: the latest
turn's (the engine computed every earlier position of the sequence in that turn's final attempt, or found
it in its prefix cache: areal_hpc.generator.routing), the positions after it unknown. A chat (`Conversation`) grows the current sequence:

    first call          render(messages, tools, generation prompt)             -> a new sequence (context)
    a sampled turn      its token ids as the engine gave them, EOS included     -> appended (sampled)
    next call, whose messages extend the conversation (same tools, the earlier messages and the
    assistant replies as returned, compared by structure):
        delta = render(conv + new, generation prompt) minus render(conv), after checking that the
        first is a prefix-extension of the second, taken from the end of the last assistant turn
        (so the glue, e.g. ChatML's "\\n" after <|im_end|>, is added: it is never sampled)
                                                                                -> appended (context)
        the template rewrote earlier turns (Qwen3's drops earlier <think> blocks when a user turn
        follows): the new messages are rendered after a stub history (the system message, a user
        turn, an assistant turn) and what follows the stub's turn end is the delta
                                                                                -> appended, counted
    messages that do not extend it (the agent edited its history), or no delta found
                                                                                -> a new sequence

Earlier turns are never decoded and encoded again: a template would change them (prime-rl #1352),
and re-encoding text rarely gives back the ids that were sampled. So what is trained is what was
sampled, earlier `<think>` blocks included where a deployment template would strip them. Every delta
starts right after a turn-end token, so its tokens never merge with the text before it.

Written here because transformers renders whole conversations only; appending to the sampled ids
with the template's own deltas is the part no library does (AReaL's "concat" mode hard-codes ChatML;
verl renders each tool message alone and loses the glue, verl #6501).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from areal_hpc.protocol import routing_unknown

STUB = "areal-hpc stub turn"
"""The stub assistant turn's content, found again in its render to locate the end of its turn."""


@dataclass
class Sequence:
    """One trained sequence: its tokens and, per token, what the trainer needs (all of one length)."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled, trained; 0: context
    behav_logprobs: list[float] = field(default_factory=list)  # 0.0 on context
    versions: list[int] = field(default_factory=list)  # -1 on context
    routing: np.ndarray | None = None  # [n, L, K] of the latest turn's n positions, when the engine records it

    def add_context(self, ids: list[int]) -> None:
        n = len(ids)
        self.tokens += ids
        self.loss_mask += [0] * n
        self.behav_logprobs += [0.0] * n
        self.versions += [-1] * n

    def add_sampled(
        self, ids: list[int], behav_logprobs: list[float], versions: list[int], routing: np.ndarray | None = None
    ) -> None:
        """Append a turn sampled after this sequence's tokens; `routing` (when recorded) covers the sequence
        with the turn, and replaces the earlier turn's."""
        if not len(ids) == len(behav_logprobs) == len(versions):
            raise ValueError(
                f"a sampled turn needs one logprob and one version per token: "
                f"{len(ids)} ids, {len(behav_logprobs)} logprobs, {len(versions)} versions"
            )
        if routing is not None and len(routing) != len(self.tokens) + len(ids):
            raise ValueError(
                f"a turn's routing covers its context and output: {len(routing)} positions for "
                f"{len(self.tokens)} context tokens and {len(ids)} sampled"
            )
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.behav_logprobs += [float(x) for x in behav_logprobs]
        self.versions += [int(v) for v in versions]
        self.routing = routing

    def trained_length(self) -> int:
        """The length up to its last sampled token: context after it is never trained or needed."""
        return max((i + 1 for i, m in enumerate(self.loss_mask) if m), default=0)


class EpisodeTokens:
    """An episode's token record: its sequences, and the tokens of its last sampled turn."""

    def __init__(self):
        self.sequences: list[Sequence] = []
        self.answer_ids: list[int] = []  # the final assistant turn's sampled tokens: what reward.kind scores

    @property
    def current(self) -> Sequence:
        if not self.sequences:
            raise RuntimeError("the episode has no sequence yet: start one with its context first")
        return self.sequences[-1]

    @property
    def num_tokens(self) -> int:
        """Tokens in all of its sequences (what `rollout.max_episode_tokens` bounds)."""
        return sum(len(s.tokens) for s in self.sequences)

    def start(self, context_ids: list[int]) -> list[int]:
        """Begin a new sequence with `context_ids`; the earlier ones are kept and trained."""
        self.sequences.append(Sequence())
        self.current.add_context(list(context_ids))
        return self.current.tokens

    def extend_to(self, context_ids: list[int]) -> list[int]:
        """The token-level rule: continue the current sequence when `context_ids` extends it (the rest
        is context), otherwise start a new one. Returns the current sequence's tokens."""
        context_ids = list(context_ids)
        if self.sequences and context_ids[: len(self.current.tokens)] == self.current.tokens:
            self.current.add_context(context_ids[len(self.current.tokens) :])
            return self.current.tokens
        return self.start(context_ids)

    def add_context(self, ids: list[int]) -> None:
        self.current.add_context(list(ids))

    def add_sampled(self, ids: list[int], behav_logprobs: list[float], versions: list[int], routing=None) -> None:
        self.current.add_sampled(list(ids), list(behav_logprobs), list(versions), routing)
        self.answer_ids = list(ids)

    def arrays(self) -> dict[str, np.ndarray]:
        """The trained arrays: the sequences concatenated, each cut after its last sampled token, those
        with none left out. `tokens`, `loss_mask`, `behav_logprobs`, `versions` are [N];
        `seq_lens` [S] sums to N; `answer_ids` [A]; `routing` [N, L, K] when the turns carried routing
        (else None), unknown past each sequence's latest turn."""
        kept = [(s, s.trained_length()) for s in self.sequences]
        kept = [(s, n) for s, n in kept if n]

        def cat(name, dtype):
            return np.asarray([x for s, n in kept for x in getattr(s, name)[:n]], dtype)

        return {
            "routing": _routing([(s.routing, n) for s, n in kept]),
            "tokens": cat("tokens", np.int32),
            "seq_lens": np.asarray([n for _, n in kept], np.int32),
            "loss_mask": cat("loss_mask", np.uint8),
            "behav_logprobs": cat("behav_logprobs", np.float32),
            "versions": cat("versions", np.int32),
            "answer_ids": np.asarray(self.answer_ids, np.int32),
        }


def _routing(parts: list[tuple[np.ndarray | None, int]]) -> np.ndarray | None:
    """The sequences' routing concatenated, each cut or padded (unknown) to its trained length `n`; None when
    no turn carried routing."""
    shaped = [r for r, _ in parts if r is not None]
    if not shaped:
        return None
    sample = shaped[0]
    out = np.full((sum(n for _, n in parts), *sample.shape[1:]), routing_unknown(sample.dtype), sample.dtype)
    at = 0
    for routing, n in parts:
        if routing is not None:
            out[at : at + min(n, len(routing))] = routing[:n]
        at += n
    return out


class Conversation:
    """A chat over an episode's tokens: each call's messages become context, each sampled turn is kept
    as sampled (the module docstring has the rules).

    `turn_end` is the text of the token that ends an assistant turn in the template (default: the
    tokenizer's EOS, `<|im_end|>` for Qwen's instruct models). `template_kwargs` go to every render
    (e.g. `enable_thinking`). `rewrites` counts the deltas taken after a stub history."""

    def __init__(self, tokenizer, episode: EpisodeTokens, *, template_kwargs: dict | None = None, turn_end=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {tokenizer.name_or_path!r} has no chat template: chat calls need one "
                "(a workflow can build its tokens itself and call client.generate)"
            )
        self.tokenizer = tokenizer
        self.episode = episode
        self.template_kwargs = dict(template_kwargs or {})
        self.turn_end = turn_end or tokenizer.eos_token
        self.turn_end_id = tokenizer.convert_tokens_to_ids(self.turn_end)
        self.rewrites = 0
        self.messages: list[dict] | None = None  # the conversation so far, ending with the assistant's reply
        self.tools: list[dict] | None = None
        self._pending: tuple[list[dict], list[dict] | None] | None = None  # the call awaiting its turn
        self._closed = True  # whether the last sampled turn ended with `turn_end`
        self._mark: tuple[int, int] | None = None  # the episode's shape when `messages` last matched it

    def prompt_ids(self, messages, tools=None) -> list[int]:
        """Add to the episode what `messages` (dicts or openai message objects) bring, and return the
        tokens the next turn continues: the current sequence, as the engine must see it."""
        msgs = [_normalize_message(m) for m in messages]
        if not msgs:
            raise ValueError("messages is empty: a chat call needs at least one message")
        tools = [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else dict(t) for t in tools or []]
        tools = tools or None
        delta = None
        if self._extended_by(msgs, tools):
            delta = self._delta(self.messages, msgs[len(self.messages) :], tools)
        if delta is None:
            self.episode.start(self._encode(self._render(msgs, tools, generation=True)))
        else:
            self.episode.add_context(self._encode(delta if self._closed else self.turn_end + delta))
        self._pending = (msgs, tools)
        return list(self.episode.current.tokens)

    def add_turn(self, token_ids, behav_logprobs, versions, message, routing=None) -> None:
        """Record the turn sampled for the last `prompt_ids` and the assistant `message` returned for it
        (what a following call's messages must contain to extend the conversation); `routing` as
        `Sequence.add_sampled`."""
        if self._pending is None:
            raise RuntimeError("add_turn without prompt_ids: a turn answers a call")
        token_ids = list(token_ids)
        self.episode.add_sampled(token_ids, behav_logprobs, versions, routing)
        msgs, self.tools = self._pending
        self._pending = None
        self.messages = [*msgs, _normalize_message(message)]
        self._closed = bool(token_ids) and token_ids[-1] == self.turn_end_id
        self._mark = (len(self.episode.sequences), len(self.episode.current.tokens))

    def _extended_by(self, msgs: list[dict], tools) -> bool:
        if self.messages is None or self._mark != (len(self.episode.sequences), len(self.episode.current.tokens)):
            return False  # no turn yet, or the episode went on without this conversation
        k = len(self.messages)
        return (
            tools == self.tools
            and len(msgs) >= k
            and all(_same(a, b) for a, b in zip(msgs[:k], self.messages, strict=True))
        )

    def _delta(self, conv: list[dict], new: list[dict], tools) -> str | None:
        """The text that follows the last assistant turn's end, up to the next generation prompt; None
        when neither the render nor the stub render shows where that turn ends."""
        end = self.turn_end
        base = self._render(conv, tools, generation=False)
        full = self._render(conv + new, tools, generation=True)
        if full.startswith(base):
            rest = full[len(base) :]
            i = base.rfind(end)
            if i >= 0 and not base[i + len(end) :].strip():  # the turn is closed in base: the glue follows
                return base[i + len(end) :] + rest
            if rest.startswith(end):  # the template closes a turn only when another follows
                return rest[len(end) :]
        head = conv[:1] if conv[0]["role"] == "system" else []
        stub = [*head, {"role": "user", "content": "?"}, {"role": "assistant", "content": STUB}]
        text = self._render(stub + new, tools, generation=True)
        start = text.find(STUB)
        i = text.find(end, start + len(STUB)) if start >= 0 else -1
        if i < 0:
            return None
        self.rewrites += 1
        return text[i + len(end) :]

    def _render(self, messages: list[dict], tools, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation, **self.template_kwargs
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes the special tokens itself (as apply_chat_template(tokenize=True) encodes).
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _normalize_message(message) -> dict:
    """A message as a plain dict the way templates read it: `content` a string ("" for None, text parts
    joined), tool-call `arguments` a dict where they are a JSON object (HF templates expect one; the
    OpenAI format carries a JSON string)."""
    d = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if "role" not in d:
        raise ValueError(f"a message needs a 'role': {d!r}")
    content = d.get("content")
    if isinstance(content, list):
        parts = [p.model_dump() if hasattr(p, "model_dump") else p for p in content]
        if any(p.get("type", "text") != "text" for p in parts):
            raise ValueError(f"only text content is supported, got parts of types {[p.get('type') for p in parts]}")
        content = "".join(p["text"] for p in parts)
    d["content"] = content or ""
    calls = d.pop("tool_calls", None)
    if calls:
        d["tool_calls"] = [_tool_call(c) for c in calls]
    return d


def _tool_call(call) -> dict:
    call = call.model_dump(exclude_none=True) if hasattr(call, "model_dump") else dict(call)
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    return {**call, "type": call.get("type", "function"), "function": function}


def _same(a: dict, b: dict) -> bool:
    """Equal as a template would render them: role, content, name, tool_call_id, and tool calls by name
    and arguments (their ids are the client's, and an agent may drop them)."""

    def key(m):
        calls = [(c["function"].get("name"), c["function"].get("arguments")) for c in m.get("tool_calls", [])]
        return m["role"], m["content"], m.get("name"), m.get("tool_call_id"), calls

    return key(a) == key(b)
