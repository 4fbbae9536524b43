"""Multi-turn rollout workflows: the one seam where a user writes rollout logic (`rollout.workflow`).

A workflow is a subclass of `Workflow`, named in the config as `package.module:Name` or
`path/to/file.py:Name` and loaded by `load_workflow`. Each generator rank builds it once, with no
arguments, and calls `arun_episode` once per episode: a GRPO group of n is n calls on one data row.
Everything else (versions, staleness, packing, advantages) stays the system's.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from areal_hpc.errors import ConfigError

SETTING = "rollout.workflow"


class Workflow(abc.ABC):
    """One episode for one data row: ask the policy for a turn, look at what came back, run tools or an
    environment, append their output, ask again; return the episode's reward or leave it to the reward
    workers.

    `client` is the episode's own client, built by the system:
      - `await client.chat.completions.create(messages=..., tools=...)` answers like the `openai`
        package's `AsyncOpenAI`: `resp.choices[0].message` has `content` and `tool_calls` parsed from
        the model's output (`rollout.tool_format`), so agent code written for that client trains as is;
      - `await client.generate(context_ids, max_tokens)` is the token-level call for a workflow that
        builds its tokens itself.

    `row` is the data row (a dict: its `prompt` as written, `prompt_ids` formatted and tokenized, `target`,
    `kind`, and the data row's other fields as they are: areal_hpc.data.dataset.Example.row).

    Reward. A finite float returned is the episode's reward, and the reward workers are not asked. None
    leaves it to `reward.kind`, which scores the text of the final assistant turn (its sampled tokens,
    never a tool's output). Anything else (inf, NaN, a string) loses the episode, as an exception does.

    Limits. At most `rollout.max_turns` calls to the policy per episode, and `rollout.max_episode_tokens`
    tokens in all (prompt, sampled and tool tokens of all its sequences). A call past either limit, or
    with no room left in the model's context, returns at once an empty turn with finish reason
    "length" and no tool calls (it does not raise: user code could swallow an exception); the episode
    then ends as truncated (`ppo.mask_truncated` applies).

    Tokens. What is trained is exactly what the engine saw (areal_hpc.workflow.conversation): the
    sampled tokens as sampled, each tool or user message as the chat template renders it after them.
    Earlier turns are never re-rendered, so an earlier `<think>` block is trained even where a
    template would strip it from the history.

    Sequences. A call whose `messages` do not extend the conversation so far (the agent edited or
    summarised its history) starts a new sequence of the same episode. Every sequence is trained, and
    every one gets the episode's reward.

    Concurrency. Episodes run as asyncio tasks on the generator's event loop, next to the engine: an
    episode that awaits (a turn, a tool) holds up nothing, but a blocking call in `arun_episode` stops
    the engine and every other episode. Run blocking code with `await asyncio.to_thread(...)`.
    One call to the policy at a time per episode: a second `generate` or chat call on the same client
    while one is in flight raises RuntimeError (both would extend the same sequence); parallel samples
    are separate episodes (`rollout.group_size`). Tool calls may run concurrently.

    Errors. An exception ends this episode only (SystemExit and KeyboardInterrupt too): it is counted in
    `rollout/workflow_errors` and its traceback goes to the generator's log.
    """

    @abc.abstractmethod
    async def arun_episode(self, client, row: dict) -> float | None:
        """Run one episode on `row` through `client`; return its reward, or None for `reward.kind`."""


def load_workflow(spec: str) -> type[Workflow]:
    """The `Workflow` subclass that `spec` (`package.module:Name` or `path/to/file.py:Name`) names.

    Raises ConfigError naming `rollout.workflow` when the module cannot be imported, has no such
    name, or the name is not a concrete `Workflow` subclass with an `async def arun_episode` that can
    be built with no arguments."""
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name.isidentifier():
        raise ConfigError(f"{SETTING} must be 'package.module:Name' or 'path/to/file.py:Name', got {spec!r}")
    module = _import(where)
    if not hasattr(module, name):
        found = sorted(
            n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, Workflow) and v is not Workflow
        )
        raise ConfigError(
            f"{SETTING}: {where} has no attribute {name!r} "
            f"(its Workflow subclasses: {', '.join(found) if found else 'none'})"
        )
    obj = getattr(module, name)
    if not (inspect.isclass(obj) and issubclass(obj, Workflow)):
        raise ConfigError(f"{SETTING}: {spec} is {_kind(obj)}, not a subclass of areal_hpc.workflow.Workflow")
    if inspect.isabstract(obj) or not inspect.iscoroutinefunction(obj.arun_episode):
        raise ConfigError(f"{SETTING}: {spec} must define `async def arun_episode(self, client, row)`")
    try:
        inspect.signature(obj).bind()
    except TypeError as e:
        raise ConfigError(f"{SETTING}: {spec} must be built with no arguments ({e})") from e
    return obj


def _import(where: str):
    """The module at a dotted name or a .py file, or a ConfigError saying what was found instead."""
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{SETTING}: no file {where} (a relative path is read from {Path.cwd()})")
        # A stable name per file, registered before it runs, as a normal import would (dataclasses and
        # pickle look classes up in sys.modules).
        module_name = f"_areal_hpc_workflow_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ConfigError(f"{SETTING}: importing {where} raised {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and (where == e.name or where.startswith(e.name + ".")):
            raise ConfigError(
                f"{SETTING}: no module named {e.name!r} (is its package installed or on PYTHONPATH? "
                "a file is named by its path, ending in .py)"
            ) from e
        raise ConfigError(f"{SETTING}: importing {where} raised {type(e).__name__}: {e}") from e
    except Exception as e:
        raise ConfigError(f"{SETTING}: importing {where} raised {type(e).__name__}: {e}") from e


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "a function"
    if inspect.ismodule(obj):
        return "a module"
    return f"a {type(obj).__name__} object"
