"""The config's documentation, read from its source: the docstring under each field (`field_docs`), and
every section and field with its default and its kind on resume (`describe_config`, what `areal-hpc
--config-help` prints).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache

from areal_hpc.config.resume import kind_of
from areal_hpc.config.schema import Config, section_class
from areal_hpc.config.validate import CHOICES


@cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_config() -> str:
    """Every section and field with its default, its kind on resume (declared in schema.py) and its
    documentation (`areal-hpc --config-help`)."""
    lines = ["Kind of each field on resume: operational changes freely; training with --allow-change; identity never."]
    defaults = Config()
    for section in dataclasses.fields(Config):
        cls = section_class(section)
        lines.append(f"{section.name}:")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section.name), f.name)
            kind = kind_of(f"{section.name}.{f.name}")
            doc = docs.get(f.name, "")
            if f"{section.name}.{f.name}" in CHOICES:
                doc += f" One of: {', '.join(CHOICES[f'{section.name}.{f.name}'])}."
            if dataclasses.is_dataclass(value):  # a section inside the section (distill.teacher): its fields
                lines.append(f"  {f.name}:  [{kind}]")
                lines.append(_fill(doc, "      "))
                inner = field_docs(type(value))
                for g in dataclasses.fields(value):
                    lines.append(f"    {g.name} = {getattr(value, g.name)!r}")
                    lines.append(_fill(inner.get(g.name, ""), "        "))
                continue
            lines.append(f"  {f.name} = {value!r}  [{kind}]")
            lines.append(_fill(doc, "      "))
    return "\n".join(lines)


def _fill(doc: str, indent: str) -> str:
    return textwrap.fill(doc, width=96, initial_indent=indent, subsequent_indent=indent)
