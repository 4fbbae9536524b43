"""The resume rules a run directory applies (areal_hpc.rundir): each field's kind, read from its
declaration (areal_hpc.config.kinds), and which fields `--allow-change` lets a resume change.
"""

from __future__ import annotations

from areal_hpc.config.kinds import IDENTITY, TRAINING
from areal_hpc.config.schema import FIELD_KINDS
from areal_hpc.errors import ConfigError


def config_fields() -> list[str]:
    """Every field of `Config` as `section.field`."""
    return list(FIELD_KINDS)


def kind_of(field: str) -> str:
    """The kind of `field`: `section.field`, or an entry of a mapping field such as `cluster.env.NAME` (its
    field's)."""
    return FIELD_KINDS[".".join(field.split(".")[:2])]


def allowed_fields(allow_change: list[str]) -> dict[str, str]:
    """The training fields that `--allow-change` names (a field, or a section: its training fields), each
    with the argument that named it. A name that is no field or section, or names only identity fields,
    is refused: an identity field never changes on resume."""
    fields = config_fields()
    allowed = {}
    for name in allow_change:
        covered = [f for f in fields if f == name or f.startswith(f"{name}.") or name.startswith(f"{f}.")]
        if not covered:
            raise ConfigError(f"--allow-change {name}: no such config field or section (see areal-hpc --config-help)")
        if all(kind_of(f) == IDENTITY for f in covered):
            raise ConfigError(
                f"--allow-change {name}: {name} is identity, which a resumed run never changes; "
                "pick another experiment.trial, or start afresh with --fresh"
            )
        allowed.update({f: name for f in covered if kind_of(f) == TRAINING})
    return allowed
