#!/usr/bin/env python
"""Convert a math or code data set of a common layout into the project's rows (areal_hpc.data.dataset):

    math: {"prompt": ..., "answer": ...}          code: {"prompt": ..., "tests": [{"input", "output"}, ...]}

    python tools/prepare_data.py IN --kind math -o train.jsonl
    python tools/prepare_data.py IN --kind code -o train.jsonl [--prompt-field F] [--target-field F]

IN is anything `data.train_path` reads (JSONL, a JSON list, parquet, a `datasets` save_to_disk directory).
Fields are found by name unless given:

    prompt  prompt, problem, question, input, instruction, description
    math    answer, final_answer, expected_answer, ground_truth, gt, target; else the last \\boxed{...} of
            solution (MATH); an answer ending in '#### 42' keeps what follows the marks (GSM8K)
    code    tests, test_cases, input_output, public_tests: a list of {input, output}, or {inputs: [...],
            outputs: [...]} / {input: [...], output: [...]} (APPS, CodeContests), either as JSON text

A row that cannot be converted is skipped and counted, the first few named; the output is read back
through the project's loader before this script says it is done.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from areal_hpc.config import ConfigError
from areal_hpc.data.dataset import load_dataset, read_rows
from areal_hpc.reward import REWARD_KINDS
from areal_hpc.reward.math import last_boxed

PROMPT_FIELDS = ("prompt", "problem", "question", "input", "instruction", "description")
ANSWER_FIELDS = ("answer", "final_answer", "expected_answer", "ground_truth", "gt", "target")
SOLUTION_FIELDS = ("solution", "response", "output")
TESTS_FIELDS = ("tests", "test_cases", "input_output", "public_tests")


class Skip(ValueError):
    """Why a row cannot be converted."""


def _field(row: dict, names: tuple[str, ...], given: str | None):
    for name in (given,) if given else names:
        value = row.get(name)
        if value not in (None, "", [], {}):
            return name, value
    return None, None


def math_answer(row: dict, field: str | None = None) -> str:
    name, value = _field(row, ANSWER_FIELDS, field)
    if name is not None:
        text = str(value).strip()
        if "####" in text:  # GSM8K: the reasoning, then '#### <answer>'
            text = text.rsplit("####", 1)[1].strip().replace(",", "")
        boxed = last_boxed(text)
        return boxed.strip() if boxed is not None else text
    if field is None:
        _, solution = _field(row, SOLUTION_FIELDS, None)
        boxed = last_boxed(str(solution)) if solution is not None else None
        if boxed is not None and boxed.strip():
            return boxed.strip()
    raise Skip(f"no answer ({field or ', '.join(ANSWER_FIELDS)}, or a \\boxed{{}} in {', '.join(SOLUTION_FIELDS)})")


def code_tests(row: dict, field: str | None = None) -> list[dict]:
    name, value = _field(row, TESTS_FIELDS, field)
    if name is None:
        raise Skip(f"no tests ({field or ', '.join(TESTS_FIELDS)})")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Skip(f"'{name}' is text but not JSON") from None
    if isinstance(value, dict):  # parallel lists: APPS {inputs, outputs}, CodeContests {input, output}
        ins = value.get("inputs", value.get("input"))
        outs = value.get("outputs", value.get("output"))
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise Skip(f"'{name}' is an object without equal lists inputs/outputs (or input/output)")
        value = [{"input": i, "output": o} for i, o in zip(ins, outs)]
    if not isinstance(value, list) or not value:
        raise Skip(f"'{name}' holds no tests")
    tests = []
    for t in value:
        if not isinstance(t, dict) or "output" not in t:
            raise Skip(f"'{name}' has a test without 'output'")
        i, o = t.get("input", ""), t["output"]
        if isinstance(i, list):  # some sets keep stdin as a list of lines
            i = "\n".join(map(str, i))
        if not isinstance(i, str) or not isinstance(o, (str, int, float)):
            raise Skip(f"'{name}' has a test whose input or output is not text")
        tests.append({"input": i, "output": str(o)})
    return tests


def convert_row(row, kind: str, prompt_field: str | None = None, target_field: str | None = None) -> dict:
    """One row of the project's layout; raises Skip with the reason."""
    if not isinstance(row, dict):
        raise Skip(f"not an object ({type(row).__name__})")
    name, prompt = _field(row, PROMPT_FIELDS, prompt_field)
    if name is None or not isinstance(prompt, str) or not prompt.strip():
        raise Skip(f"no prompt text ({prompt_field or ', '.join(PROMPT_FIELDS)})")
    if kind == "math":
        return {"prompt": prompt, "answer": math_answer(row, target_field)}
    return {"prompt": prompt, "tests": code_tests(row, target_field)}


def convert(src: str | Path, out: str | Path, kind: str, prompt_field=None, target_field=None, show=print) -> int:
    """Write the converted rows of `src` to `out` (JSONL); returns the number written."""
    written, reasons, named = 0, Counter(), []
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".partial")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for where, row in read_rows(src, setting="IN"):
                try:
                    f.write(json.dumps(convert_row(row, kind, prompt_field, target_field), ensure_ascii=False) + "\n")
                    written += 1
                except Skip as e:
                    reasons[str(e)] += 1
                    if len(named) < 5:
                        named.append(f"{where}: {e}")
    except BaseException:  # an unreadable input (a malformed line): no half-written file stays behind
        tmp.unlink(missing_ok=True)
        raise
    if not written:
        tmp.unlink()
        raise ConfigError(f"{src}: no row could be converted to {kind} rows: " + "; ".join(named))
    tmp.rename(out)
    load_dataset(out, kind, setting="the converted file")  # what the run will read
    show(f"wrote {written} {kind} rows to {out}")
    if reasons:
        show(f"skipped {sum(reasons.values())} rows: " + "; ".join(f"{n} x {r}" for r, n in reasons.most_common()))
        show("first skipped: " + "; ".join(named))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("src", metavar="IN", help="JSONL, JSON list, parquet, or a datasets save_to_disk directory")
    p.add_argument("-o", "--output", required=True, help="the JSONL file to write")
    p.add_argument("--kind", choices=REWARD_KINDS, required=True, help="reward.kind the rows are for")
    p.add_argument("--prompt-field", help=f"the prompt's field (default: the first of {', '.join(PROMPT_FIELDS)})")
    p.add_argument("--target-field", help="the answer's (math) or tests' (code) field (default: found by name)")
    args = p.parse_args(argv)
    try:
        convert(args.src, args.output, args.kind, args.prompt_field, args.target_field)
    except ConfigError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
