"""Multi-turn rollout workflows: the one seam where a user writes rollout logic (`rollout.workflow`).

A workflow is a subclass of `Workflow`, whose docstring is the contract, named in the config as
`package.module:Name` or `path/to/file.py:Name` and loaded by `load_workflow` before a run starts, so a
bad name fails at launch, not on the generators. A GRPO group of n is n episodes of one data row;
everything else (versions, staleness, packing, advantages) stays the system's.
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
    """The workflow contract, stated here once (docs/agents.md is the guide to it, with an example).

    One episode for one data row: ask the policy for a turn, look at what came back, run tools or an
    environment, append their output, ask again; return the episode's reward or leave it to the reward
    workers. Each generator builds the workflow once, with no arguments, and shares it among all its
    episodes: keep an episode's state in local variables.

    `client` is the episode's own client (areal_hpc.workflow.client), built by the system:
      - `await client.chat.completions.create(messages=..., tools=...)` answers like the `openai`
        package's `AsyncOpenAI`: an `openai` ChatCompletion whose `choices[0].message` has `content` and
        `tool_calls` parsed from the model's output (`rollout.tool_format`), plus `token_ids`, so agent
        code written for that client trains as is. `extra_body={"chat_template_kwargs": {...}}` reaches
        the chat template, the same on every call of an episode. Sampling is the run's: a `temperature`
        or `top_p` other than `rollout.temperature` and `rollout.top_p`, or `n` != 1, raises ValueError
        (the trainer recomputes each sampled token's logprob at the run's settings); so does any argument
        given a value that the engine would not apply, rather than being ignored (`stop`, `seed`,
        `logit_bias`, the penalties, `response_format`, `stream=True`: a turn comes back whole, a forced
        `tool_choice`), while what frameworks send without changing the sampling is accepted (`model`,
        `parallel_tool_calls`, `stream_options`, `user`, `metadata`, `store`, `max_completion_tokens` as
        `max_tokens`, an empty `stop`): areal_hpc.workflow.client.ACCEPTED.
      - `client.base_url` and `client.api_key` make the same chat call over HTTP, for agent code that
        takes a base URL (`openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)`, any
        framework, a program in another process): the rank's OpenAI-compatible endpoint
        (areal_hpc.workflow.endpoint, `rollout.openai_endpoint`), where the key makes a request a call
        of this episode, with the same record, limits and refusals (HTTP 400; 409 for a second call in
        flight) and `stream=true` answered. The key expires when the episode ends.
      - `await client.run_command(args, time_limit_s)` runs a program with OPENAI_BASE_URL and
        OPENAI_API_KEY set to those two, without blocking the loop, and returns its exit status and
        output (`CommandResult`); past the limit its process group is killed and TimeoutError raised.
      - `await client.generate(context_ids, max_tokens=None)` is the token-level call for a workflow that
        builds its tokens itself: one turn after `context_ids`, returned as `token_ids`,
        `behav_logprobs`, `versions` and `finish_reason`; ids that extend the sequence so far continue it.
      - `await client.run_tool(name, arguments)` runs a shipped tool (areal_hpc.workflow.tools; the
        arguments a dict or a tool call's JSON string) and returns the text for the model; a failure
        returns `error: ...`, counted in `rollout/tool_errors`, and never raises. A tool of your own is
        a function the workflow calls itself.

    `row` is a dict: `prompt` (the data set's text, as it is), `prompt_ids` (the prompt formatted by
    `data.chat_template`, `data.system_prompt` and `data.prompt_suffix`, tokenized), `target` (the answer,
    or the tests), `kind`, and every other field of the data row as it is (areal_hpc.data.dataset
    `Example.row`); a data row may not have fields of those names. The row goes with every request and
    into checkpoints: give large files as paths. A chat workflow builds its messages from `prompt`.

    Reward. A finite float returned is the episode's reward, and the reward workers are not asked. None
    leaves it to `reward.kind`, which scores the text of the final assistant turn (its sampled tokens,
    never a tool's output). Anything else (inf, NaN, a string) loses the episode, as an exception does.
    Either way `reward.overlong_penalty` (when set) is added, counted on the final turn's tokens.

    Limits. At most `rollout.max_turns` calls to the policy per episode, `rollout.max_new_tokens` tokens
    a turn, and `rollout.max_episode_tokens` tokens in all (prompt, sampled and tool tokens of all its
    sequences; 0: the model's context). A call past a limit, or with no room left in the model's
    context, returns at once an empty turn with finish reason "length" and no tool calls (it does not
    raise: user code could swallow an exception); the episode then ends as truncated
    (`ppo.mask_truncated` applies, `rollout/truncated` counts it).

    Tokens. What is trained is exactly what the engine saw (areal_hpc.workflow.conversation): the prompt,
    the sampled tokens as sampled, each tool or user message as the chat template renders it after them.
    Earlier turns are never re-rendered, so an earlier `<think>` block is trained even where a template
    would strip it from the history; where a template rewrites earlier turns, a new message's tokens
    come from a render that does not depend on them (`rollout/template_rewrites`). The loss covers the
    sampled tokens only. A turn ends at the tokenizer's EOS token: use an instruct model whose EOS is its
    template's turn end (Qwen2.5-Instruct's `<|im_end|>`).

    Sequences. A call whose `messages` extend the conversation so far (the earlier messages unchanged,
    the returned assistant message included) adds only the new messages' tokens; one whose messages do
    not (the agent dropped, edited or summarised its history) starts a new sequence of the same episode.
    Every sequence is trained, and every one gets the episode's reward.

    Concurrency. Episodes run as asyncio tasks on the generator's event loop, next to its engine, each on
    that engine (its prefix cache is reused between turns): an episode that awaits (a turn, a tool) holds
    up nothing, but a blocking call in `arun_episode` (`requests.get`, `subprocess.run`, a long
    computation) stops the engine and every other episode. Run blocking code with
    `await asyncio.to_thread(...)`, or an async library. One call to the policy at a time per episode: a
    second `generate` or chat call on the same client while one is in flight raises RuntimeError (both
    would extend the same sequence); parallel samples are separate episodes (`rollout.group_size`). Tool
    calls may run concurrently.

    Errors. An exception ends this episode only (SystemExit and KeyboardInterrupt too): its traceback
    goes to the generator's log, it is counted in `rollout/workflow_errors`, and its group's advantages
    are computed over the other episodes (a group with none left is counted in `rollout/lost_groups` and
    another prompt takes its place). When more than half of a step's episodes fail, the run stops with
    the first traceback. A tool that fails is not an exception: the model reads `error: ...`.

    Checkpoints. An episode running at a checkpoint is saved as its turns, not its Python state: after the
    resume `arun_episode` runs again from the start on the same row, and each call to the policy made after
    the same context as before gets the saved turn back (the one in flight goes on from its tokens);
    tools run again. A workflow whose steps between turns are deterministic thus resumes where it was; one
    that draws at random, or whose tools answer otherwise the second time, samples anew from the first
    call whose context differs (areal_hpc.generator.resume).
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
