"""Reading a config: YAML file + `section.field=value` overrides -> a validated `Config`, and writing one
back. Unknown keys and wrong types raise `ConfigError` naming the key (with the nearest valid one).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_hpc.config.schema import Config, section_class
from areal_hpc.config.validate import validate
from areal_hpc.errors import ConfigError

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""SafeLoader's rules on libyaml's parser when PyYAML has it (a tenth of the time); a file it refuses is
read again by SafeLoader, whose message quotes the line."""


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply `section.field=value` overrides, validate, and return it."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        text = path.read_text()
        try:
            data = yaml.load(text, Loader=_YAML_LOADER) or {}
        except yaml.YAMLError:
            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    _check_keys(data, Config, where=str(path) if path else "config")
    dotlist = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form section.field=value")
        _check_key_path(key.strip().split("."), Config, where="override")
        dotlist.append(item)
    try:
        merged = OmegaConf.merge(_schema(), data, OmegaConf.from_dotlist(dotlist))
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    _split_in_gpus(cfg)
    validate(cfg)
    return cfg


@functools.cache
def _schema():
    """The `Config` schema as OmegaConf builds it (most of a load's time; `merge` copies it, never changes it)."""
    return OmegaConf.structured(Config)


def _split_in_gpus(cfg: Config) -> None:
    """An older config's or run directory's split in nodes (`allocation.gen_nodes`) as the GPUs it means."""
    a, g = cfg.allocation, cfg.cluster.gpus_per_node
    if a.gen_nodes is None:
        return
    if a.gen_gpus is not None and a.gen_gpus != a.gen_nodes * g:
        raise ConfigError(
            f"allocation.gen_nodes ({a.gen_nodes}) and allocation.gen_gpus ({a.gen_gpus}) disagree: gen_nodes is the "
            f"split in whole nodes (gen_gpus = gen_nodes x cluster.gpus_per_node = {a.gen_nodes * g}); set only gen_gpus"
        )
    a.gen_gpus, a.gen_nodes = a.gen_nodes * g, None


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (what `load_config` reads back unchanged)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unknown(key: str, known: list[str], where: str, prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(known)}"
    return ConfigError(f"{where}: unknown key '{prefix}{key}'{hint}")


def _check_keys(data: dict, cls, where: str, prefix: str = "") -> None:
    fields = _fields(cls)
    for key, value in data.items():
        if key not in fields:
            raise _unknown(str(key), list(fields), where, prefix)
        sub = section_class(fields[key])
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{prefix}{key}' must be a section (a mapping), got {value!r}")
            _check_keys(value, sub, where, prefix=f"{prefix}{key}.")


def _check_key_path(parts: list[str], cls, where: str) -> None:
    prefix = ""
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            raise _unknown(part, list(fields), where, prefix)
        sub = section_class(fields[part])
        if sub is None:
            if i != len(parts) - 1:
                raise ConfigError(f"{where}: '{prefix}{part}' is a value, not a section")
            return
        cls, prefix = sub, f"{prefix}{part}."
    raise ConfigError(f"{where}: '{'.'.join(parts)}' is a section; override one of its fields")


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0]
    if "Value" in msg and "could not be converted" in msg or "Invalid type" in msg or "is not a" in msg:
        return f"{key}: wrong type: {msg}"
    return f"{key}: {msg}" if key else msg
