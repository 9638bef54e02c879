"""A job file's mapping read into typed dataclasses, the config's machinery apart from its
sections: each field's type, bounds and choices checked (scalars by a row of the settings
table: the table's own for ``cluster`` and ``sync``, else one made from the field), an
unknown key refused with a did-you-mean, a missing required key named, and ``--set
KEY=VALUE`` overrides applied to the mapping first.

It is its own module because it knows no section: ``ssdsgd/config.py`` declares the
sections and the checks across keys and calls ``build``; the rules of how a value is
read and how an error is worded (one line, the key's dotted path first) live here once.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import field
from typing import Literal

import yaml

from . import settings as S


class ConfigError(ValueError):
    """A job configuration is invalid. The message is one line naming the key."""


def typed_field(default=dataclasses.MISSING, *, min=None, max=None, above=None,
                required=False, doc="", factory=None):
    """A dataclass field with validation metadata (min, max inclusive; above exclusive)."""
    meta = {"min": min, "max": max, "above": above, "required": required, "doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    if default is dataclasses.MISSING:
        default = None
    return field(default=default, metadata=meta)


def describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + describe(typing.get_args(tp)[0]).replace("an ", "").replace(
            "a ", "") + "s"
    if origin is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return describe(inner[0]) + " or null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def show(value) -> str:
    text = repr(value) if isinstance(value, str) else yaml.safe_dump(
        value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
    return text if len(text) <= 60 else text[:57] + "..."


def _convert(value, tp, path: str, meta: dict):
    """Check ``value`` against type ``tp`` (and bounds); return the converted value.
    Scalars are checked by a settings row: the table's own for the ``cluster`` and ``sync``
    keys, else one made from the field's type and bounds."""
    setting = meta.get("setting")
    origin = typing.get_origin(tp)
    if setting is None and origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _convert(value, inner, path, meta)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {describe(tp)}, got {show(value)}")
        item = typing.get_args(tp)[0]
        return [_convert(v, item, f"{path}[{i}]", {}) for i, v in enumerate(value)]
    if setting is None:
        choices = typing.get_args(tp) if origin is Literal else ()
        setting = S.Setting(path, str if choices else tp, None, meta.get("doc", ""),
                            choices=choices, min=meta.get("min"), max=meta.get("max"),
                            above=meta.get("above"))
    try:
        return setting.check(value)
    except S.SettingError as e:
        raise ConfigError(f"{path}: {e}, got {show(value)}") from None


def build(cls, raw, path: str):
    """Build dataclass ``cls`` from mapping ``raw``; ``path`` is its dotted prefix."""
    where = path or "the top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {show(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            dotted = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{dotted}: unknown key ({hint}expected one of: "
                              f"{', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        dotted = f"{path}.{name}" if path else name
        if name in raw:
            kwargs[name] = _convert(raw[name], hints[name], dotted, f.metadata)
        elif f.metadata.get("required"):
            raise ConfigError(f"{dotted}: required key is missing (expected "
                              f"{describe(hints[name])})")
    return cls(**kwargs)


def apply_override(raw: dict, text: str) -> None:
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. sync.delay_steps=10")
    key, _, value_text = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p or not p.replace("_", "").isalnum() for p in parts):
        raise ConfigError(f"--set {text!r}: expected a dotted key like sync.delay_steps "
                          "before '='")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"--set {text!r}: value is not a YAML scalar or list ({first})") \
            from None
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {text!r}: {'.'.join(parts[:i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def copy_tree(obj):
    if isinstance(obj, dict):
        return {k: copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_tree(v) for v in obj]
    return obj
