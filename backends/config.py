"""Typed recipe configs (frozen ``attrs`` classes) and ``key=value`` command-line overrides.

``apply_overrides(cfg, ["actor.optim.lr=1e-5", "rollout.n=8"])`` returns a new config; each value is
parsed according to the field's declared type (int, float, bool, str, Literal choices, Optional, tuples,
nested configs). An unknown key is an error that names the closest valid keys. Values are parsed, never
evaluated.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Iterable, Literal, Union, get_args, get_origin

import attrs

__all__ = ["ConfigError", "apply_overrides", "config_keys", "config_to_dict", "parse_value"]


class ConfigError(ValueError):
    """A bad command-line override: unknown key or a value that does not parse as the field's type."""


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-Python dict of a config (for summaries and logs)."""
    return attrs.asdict(cfg, recurse=True, value_serializer=lambda _i, _f, v: list(v) if isinstance(v, tuple) else v)


def _fields(cls: type) -> dict[str, attrs.Attribute]:
    attrs.resolve_types(cls)
    return {f.name: f for f in attrs.fields(cls)}


def config_keys(cfg_or_cls: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key of a config class or instance."""
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    keys = []
    for name, f in _fields(cls).items():
        if isinstance(f.type, type) and attrs.has(f.type):
            keys.extend(config_keys(f.type, f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys


_NONE = {"none", "null", "~"}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_value(text: str, tp: Any, key: str = "value") -> Any:
    """Parse the string ``text`` as type ``tp`` (no evaluation of code)."""
    origin, args = get_origin(tp), get_args(tp)
    stripped = text.strip()
    if origin in (Union, types.UnionType):
        if type(None) in args and stripped.lower() in _NONE:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return parse_value(text, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={text!r} matches none of {tp}: " + "; ".join(errors))
    if origin is Literal:
        for choice in args:
            if str(choice) == stripped:
                return choice
        raise ConfigError(f"{key}={text!r} is not one of {', '.join(map(repr, args))}")
    if origin in (tuple, list):
        body = stripped.strip("()[]")
        parts = [p for p in (s.strip() for s in body.split(",")) if p]
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            items = [parse_value(p, args[0], key) for p in parts]
        elif origin is tuple and args:
            if len(parts) != len(args):
                raise ConfigError(f"{key}={text!r} needs {len(args)} comma-separated values")
            items = [parse_value(p, a, key) for p, a in zip(parts, args)]
        else:
            items = [parse_value(p, args[0] if args else str, key) for p in parts]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        low = stripped.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ConfigError(f"{key}={text!r} is not a boolean (true/false)")
    if tp is int:
        try:
            return int(stripped.replace("_", ""))
        except ValueError:
            try:
                as_float = float(stripped)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
            raise ConfigError(f"{key}={text!r} is not an integer") from None
    if tp is float:
        try:
            return float(stripped)
        except ValueError:
            raise ConfigError(f"{key}={text!r} is not a number") from None
    if tp is str or tp is typing.Any:
        return text
    raise ConfigError(f"{key}: cannot parse values of type {tp} from the command line")


def _apply(cfg: Any, tree: dict[str, Any], prefix: str, root: Any) -> Any:
    """Apply a nested ``{name: text | subtree}`` of overrides with one ``evolve`` per config object, so
    that fields validated together (e.g. hidden size and head count) can change together."""
    fields = _fields(type(cfg))
    changes = {}
    for name, sub in tree.items():
        key = prefix + name
        if name not in fields:
            raise ConfigError(_unknown_key_message(key, root))
        current = getattr(cfg, name)
        if isinstance(sub, dict):
            if not attrs.has(type(current)):
                raise ConfigError(_unknown_key_message(key + "." + next(iter(sub)), root))
            changes[name] = _apply(current, sub, key + ".", root)
        elif attrs.has(type(current)):
            raise ConfigError(f"{key} is a config section; set one of its keys, e.g. {config_keys(current, key + '.')[0]}")
        else:
            changes[name] = parse_value(sub, fields[name].type, key)
    try:
        return attrs.evolve(cfg, **changes)
    except (TypeError, ValueError) as e:
        given = ", ".join(f"{prefix}{n}" for n in tree)
        raise ConfigError(f"{given}: {e}") from e


def _unknown_key_message(key: str, root: Any) -> str:
    valid = config_keys(root)
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    if not close:  # match on the last component, e.g. "lr" -> "actor.optim.lr"
        last = key.rsplit(".", 1)[-1]
        close = [k for k in valid if k.rsplit(".", 1)[-1] == last][:3] or difflib.get_close_matches(
            last, valid, n=3, cutoff=0.3
        )
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown config key {key!r}{hint} (run with --help to list all keys)"


def apply_overrides(cfg: Any, overrides: Iterable[str]) -> Any:
    """Return ``cfg`` with each ``dotted.key=value`` override applied, in order."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. actor.optim.lr=1e-5)")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(_unknown_key_message(key, cfg))
        if isinstance(node.get(leaf), dict):
            raise ConfigError(f"{key} is a config section; set one of its keys")
        node[leaf] = text  # a later override of the same key wins
    return _apply(cfg, tree, "", cfg)
