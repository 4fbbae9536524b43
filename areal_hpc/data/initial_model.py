"""The run's starting weights: the model directory (built for `tiny`), optionally warm-started by a short
supervised phase, built once before the ranks start and cached under the run root.

Why a warm start: RL only sharpens what the policy already does sometimes. A freshly initialised tiny
model never writes `\\boxed{...}`, so every reward is 0, every GRPO advantage is 0, and nothing is
learned. A few epochs of plain supervised fine-tuning on `prompt -> \\boxed{answer}<eos>` examples
(seconds on one CPU core) bring the sampled accuracy to a few tenths; from there the asynchronous RL
run raises it. With `sft.unboxed` a share of the examples is the bare answer (`prompt -> answer<eos>`,
reward 0), so the model starts boxing only part of its answers and RL has the format to teach too
(the embedded default's choice: see its config). With `sft.tool_share` a share of the examples of the
synthetic multiplication task calls the calculator first, so the model starts calling it only part of
the time and RL has the tool call to teach.

Both steps are pure functions of their settings and cached like `areal_hpc.data.tiny`'s assets: the
directory name is a hash of (base model, settings, data), written atomically.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from areal_hpc.config import Config, ConfigError
from areal_hpc.data.dataset import max_prompt_tokens
from areal_hpc.data.synthetic import synthetic_rows, worked_steps
from areal_hpc.data.tiny import BOXED, _build_atomically, _digest, build_tiny_model
from areal_hpc.workflow.conversation import Conversation, EpisodeTokens
from areal_hpc.workflow.tools import CALCULATOR_SCHEMA, calculator


def initial_model(cfg: Config) -> Path:
    """The Hugging Face directory every generator and trainer starts from (policy version 0).

    Builds what is missing (the tiny model, the warm start); cheap when both are cached. Call it from
    one process at a time per run root (the launcher, or world rank 0 before the others look).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if cfg.model.path == "tiny":
        base = build_tiny_model(cfg.model, cfg.experiment.root, cfg.experiment.seed)
    else:
        base = Path(cfg.model.path)
        if not (base / "config.json").is_file():
            raise ConfigError(f"model.path {base} is not a Hugging Face model directory (no config.json)")
    if cfg.sft.examples <= 0:
        return base
    return warm_start(cfg, base)


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
"""A Hugging Face tokenizer's vocabulary, one of these (without any, transformers builds an almost empty one)."""


def check_teacher(cfg: Config, model_dir: Path) -> None:
    """ConfigError unless `distill.teacher` (if set) is here and gives every token of the tokenizer in `model_dir`
    (the initial model's) the same id: it scores the policy's token ids as they are. The token maps are
    compared, not the sizes (Qwen2.5-1.5B and 7B share a tokenizer but pad their embeddings to 151,936 and
    152,064; that the teacher has an embedding for each of the model's is the config's check). Called with `initial_model`'s directory by the launcher and world
    rank 0, before any role starts."""
    if not cfg.distill.teacher.path:
        return
    from transformers import AutoTokenizer

    teacher_dir = Path(cfg.distill.teacher.path)
    where = f"distill.teacher.path {teacher_dir}"
    if not (teacher_dir / "config.json").is_file():
        raise ConfigError(f"{where} is not a Hugging Face model directory (no config.json): the trainers load it")
    if not any((teacher_dir / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        theirs = AutoTokenizer.from_pretrained(str(teacher_dir)).get_vocab()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: its tokenizer does not load ({e})") from None
    ours = AutoTokenizer.from_pretrained(str(model_dir)).get_vocab()
    differ = [(i, t) for t, i in ours.items() if theirs.get(t) != i]
    if differ:
        i, token = min(differ)
        other = f"id {theirs[token]}" if token in theirs else "no id"
        raise ConfigError(
            f"{where}: its tokenizer is not the model's: token {token!r} is id {i} in the model's and has {other} "
            f"in the teacher's ({len(differ)} of the model's {len(ours)} tokens differ); a teacher shares the "
            "model's tokenizer (a model of its family)"
        )


def sft_examples(cfg: Config, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of each warm-start example: the prompt as the RL run formats it
    (`data.PromptFormat`, mask 0), then the response (mask 1), one of

        direct:   steps \\boxed{answer}<eos>                 (a share `sft.unboxed`: steps answer<eos>)
        tool:     <calc>a*b<eos> <result>p\\n \\boxed{p}<eos>   (a share `sft.tool_share`)

    A tool example's turns are rendered by the tokenizer's chat template as the episode renders them
    (each message is the text it adds to the render of those before it); the calculator's answer is
    context (mask 0), as in the episode. The steps are the synthetic chain task's countdown
    (`worked_steps`; empty otherwise); a response longer than `rollout.max_new_tokens` is cut there, as
    the rollouts cut it, so the model learns to go on where it is cut. The rows: fresh synthetic ones
    (a seed the RL prompts do not use; for arithmetic every problem, the test split's too: the warm start stands in for the
    pretraining of a real base model, and the test split measures what RL adds on problems it never
    trained on; for multiplication the training split only: what RL teaches there is the tool call, and
    the test split shows it carries over to numbers never seen), or the first `sft.examples` of
    `data.train_path`, read through the same validated loader as the run (a bad row is a
    `file:line: field` error; an overlong prompt is skipped and named)."""
    from areal_hpc.data.dataset import PromptFormat, load_prompts

    d = cfg.data
    if d.train_path:
        rows = [(e.prompt, e.prompt_ids, e.target) for e in load_prompts(cfg, tokenizer, d.train_path)]
    else:
        synthetic = synthetic_rows(
            cfg.sft.examples,
            cfg.experiment.seed + 7919,
            d.synthetic_task,
            d.synthetic_max_operand,
            held_out=d.synthetic_task == "arithmetic",
        )
        ids = PromptFormat.from_config(cfg).encode(tokenizer, [r["prompt"] for r in synthetic])
        rows = [(r["prompt"], p, r["answer"]) for p, r in zip(ids, synthetic)]
    bare = random.Random(f"sft-unboxed:{cfg.experiment.seed}")
    calls = random.Random(f"sft-tool:{cfg.experiment.seed}")
    out = []
    for prompt, prompt_ids, answer in rows[: cfg.sft.examples]:
        ids = [int(t) for t in prompt_ids]
        if cfg.sft.tool_share and calls.random() < cfg.sft.tool_share:
            out.append(_tool_episode(tokenizer, prompt, answer))
            continue
        steps = "" if d.train_path else worked_steps(d.synthetic_task, prompt)
        text = steps + (str(answer) if bare.random() < cfg.sft.unboxed else f"{BOXED}{answer}}}")
        response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        response = response[: cfg.rollout.max_new_tokens]
        out.append((ids + response, [0] * len(ids) + [1] * len(response)))
    return out


def _tool_episode(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of an episode that calls the calculator on a synthetic prompt ('a*b=' -> 'a*b'),
    reads its result and answers it boxed, assembled by the rollouts' own `Conversation`: the prompt and
    the tool's result are context exactly as an episode's chat calls add them, and the two assistant
    turns are scripted sampled turns (the text the chat template writes for the assistant message)."""
    expression = prompt.removesuffix("=")
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    turns = [
        (
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": calculator(expression)},
        ),
        ({"role": "assistant", "content": f"{BOXED}{answer}}}"}, None),
    ]
    episode = EpisodeTokens()
    chat = Conversation(tokenizer, episode)
    messages = [{"role": "user", "content": prompt}]
    for reply, result in turns:
        chat.prompt_ids(messages, tools=[CALCULATOR_SCHEMA])
        sampled = _assistant_ids(tokenizer, messages, reply)
        chat.add_turn(sampled, [0.0] * len(sampled), [0] * len(sampled), reply)
        messages += [reply, result] if result else [reply]
    if len(episode.sequences) != 1:
        raise ConfigError("sft.tool_share: the chat template's renders of the tool episode do not extend each other")
    arrays = episode.arrays()
    return arrays["tokens"].tolist(), arrays["loss_mask"].tolist()


def _assistant_ids(tokenizer, messages: list[dict], reply: dict) -> list[int]:
    """The ids of `reply` as the template writes it after the generation prompt of `messages`: what the
    model samples for it, its turn end included."""
    before = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template([*messages, reply], tokenize=False)
    if not after.startswith(before):
        raise ConfigError(
            f"sft.tool_share needs a chat template that only appends: the render of an assistant message "
            f"rewrote the earlier ones ({before!r} -> {after!r})"
        )
    return tokenizer(after[len(before) :], add_special_tokens=False)["input_ids"]


def warm_start(cfg: Config, base: Path) -> Path:
    """Fine-tune `base` on `sft_examples(cfg, tokenizer)`; the loss is on the masked tokens only (the
    model's own turns, not the prompt or a tool's answer):

        loss = - mean over masked tokens of log p(token | the tokens before it)

    AdamW, `sft.epochs` passes of shuffled batches of `sft.batch_size`.
    """
    s, d = cfg.sft, cfg.data
    key = _digest(
        {
            "base": str(Path(base).resolve()),
            "sft": vars(s),
            "data": vars(d),
            "max_prompt_tokens": max_prompt_tokens(cfg),
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "synthetic_problems": "all",  # since the test split: every problem, the held-out ones too
            "seed": cfg.experiment.seed,
        }
    )

    def build(out: Path) -> None:
        import torch

        # One thread: a model this small gains nothing from more, and on a busy machine (the ranks of
        # another run, a test suite) extra threads make it 25x slower.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _train(cfg, base, out)
        finally:
            torch.set_num_threads(threads)

    return _build_atomically(Path(cfg.experiment.root) / ".assets" / f"sft-{key}", build)


def _batches(examples: list, size: int, rng: random.Random, by_length: bool, window: int = 8) -> list[list]:
    """One epoch's batches: the examples shuffled and cut into batches; `by_length` (`sft.batch_by_length`)
    first sorts them by length within runs of `window` batches and then shuffles the batches. A batch is
    padded to its longest example, so with long-tailed lengths (the chain task: median 190 tokens, a few
    at 1,024) batches of similar lengths compute about a third of what random ones do."""
    rng.shuffle(examples)
    if not by_length:
        return [examples[i : i + size] for i in range(0, len(examples), size)]
    run = window * size
    batches = []
    for i in range(0, len(examples), run):
        ordered = sorted(examples[i : i + run], key=lambda e: len(e[0]))
        batches += [ordered[j : j + size] for j in range(0, len(ordered), size)]
    rng.shuffle(batches)
    return batches


def _train(cfg: Config, base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    s = cfg.sft
    hf_logging.disable_progress_bar()
    torch.manual_seed(cfg.experiment.seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    examples = sft_examples(cfg, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    rng = random.Random(cfg.experiment.seed)
    model.train()
    started = time.monotonic()
    for epoch in range(s.epochs):
        print(
            f"warm start: epoch {epoch + 1}/{s.epochs} of {len(examples)} examples ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
        for batch in _batches(examples, s.batch_size, rng, s.batch_by_length):
            width = max(len(x) for x, _ in batch)
            ids = torch.full((len(batch), width), tok.pad_token_id)  # [batch, width]
            labels = torch.full((len(batch), width), -100)  # -100: no loss (prompt, tool answer, padding)
            for j, (x, mask) in enumerate(batch):
                x, mask = torch.tensor(x), torch.tensor(mask, dtype=torch.bool)
                ids[j, : len(x)] = x
                labels[j, : len(x)] = torch.where(mask, x, -100)
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.to(getattr(torch, cfg.model.dtype)).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
