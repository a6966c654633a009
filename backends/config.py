"""Typed recipe configs (frozen ``attrs`` classes) and ``key=value`` command-line overrides.

``apply_overrides(cfg, ["actor.optim.lr=1e-5", "rollout.n=8"])`` returns a new config; each value is
parsed according to the field's declared type (int, float, bool, str, Literal choices, Optional, tuples,
nested configs). An unknown key is an error that names the closest valid keys. Values are parsed, never
evaluated.

Presets (YAML files under a recipe's presets dir, grouped like verl's ``trainer/config/<group>/``):

- ``preset=ref/dp_ref`` applies ``<presets_dir>/ref/dp_ref.yaml`` at the section its ``_at_`` key names
  (e.g. ``_at_: reference``), or at the root when it names none;
- ``actor.optim=@optim/fsdp`` applies ``optim/fsdp.yaml`` under ``actor.optim``.

A preset expands in place into dotted overrides, so keys given after it win. Its keys are checked
like command-line keys (the error names the preset file); an unknown preset lists the available ones.
YAML is read with ``yaml.safe_load`` (PyYAML, already installed with transformers / huggingface_hub).

Function-valued keys (e.g. ``algo.estimator``) hold a string that :func:`resolve_function` turns into a
callable: a built-in name, or a reference ``package.module:function`` / ``path/to/file.py:function``
(imported, never evaluated). Recipes resolve them at start-up, so a misspelling fails before any work.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Union, get_args, get_origin

import attrs

__all__ = [
    "ConfigError",
    "apply_overrides",
    "available_presets",
    "config_help",
    "config_keys",
    "config_markdown",
    "config_rows",
    "config_to_dict",
    "expand_presets",
    "field_docs",
    "load_preset",
    "parse_value",
    "recipe_help",
    "resolve_function",
]


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
        parts = _json_list(stripped)
        if parts is None:
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
            raise ConfigError(
                f"{key} is a config section; set one of its keys, e.g. {config_keys(current, key + '.')[0]}"
            )
        else:
            changes[name] = parse_value(sub, fields[name].type, key)
    try:
        return attrs.evolve(cfg, **changes)
    except (TypeError, ValueError) as e:
        given = ", ".join(f"{prefix}{n}" for n in tree)
        message = e.args[0] if len(e.args) > 1 else e  # attrs' in_ validator adds the attribute, options and value
        raise ConfigError(f"{given}: {message}") from e


def _refuse_renamed(key: str, renamed: Mapping[str, str] | None) -> None:
    for old, new in (renamed or {}).items():
        if key == old or key.startswith(old + "."):
            raise ConfigError(f"{key} was renamed: use {new}")


def _section_keys(key: str, root: Any) -> str:
    """``; the section X has a, b`` when ``key``'s parent is a config section of ``root`` (its valid leaves)."""
    parent, node = key.rsplit(".", 1)[0] if "." in key else "", root
    for part in parent.split(".") if parent else []:
        node = getattr(node, part, None)
        if node is None or not attrs.has(type(node)):
            return ""
    if not parent:
        return ""
    names = [f.name for f in attrs.fields(type(node))]
    return f"; the section {parent} has {', '.join(names) if names else 'no keys'}"


def _unknown_key_message(key: str, root: Any) -> str:
    section = _section_keys(key, root)
    valid = config_keys(root)
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    if not close:  # match on the last component, e.g. "lr" -> "actor.optim.lr"
        last = key.rsplit(".", 1)[-1]
        close = [k for k in valid if k.rsplit(".", 1)[-1] == last][:3] or difflib.get_close_matches(
            last, valid, n=3, cutoff=0.3
        )
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown config key {key!r}{hint}{section} (run with --help to list all keys)"


def available_presets(presets_dir: str | os.PathLike) -> list[str]:
    """Every preset name (``group/name``, no extension) under ``presets_dir``, sorted."""
    root = Path(presets_dir)
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml")) if root.is_dir() else []


def load_preset(presets_dir: str | os.PathLike, name: str) -> tuple[dict[str, Any], str]:
    """``(mapping, default section)`` of the preset ``name`` (``group/name``); the section is its ``_at_``
    key ("" = the root). An unknown name is an error listing the available presets."""
    import yaml

    root = Path(presets_dir).resolve()
    path = (root / f"{name}.yaml").resolve()
    if root not in path.parents or not path.is_file():
        available = available_presets(root)
        raise ConfigError(
            f"unknown preset {name!r} (looked for {path}); available presets: "
            + (", ".join(available) if available else f"none in {root}")
        )
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"preset {name!r} ({path}) must hold a mapping of keys, got {type(data).__name__}")
    at = data.pop("_at_", "") or ""
    if not isinstance(at, str):
        raise ConfigError(f"preset {name!r}: _at_ must be a dotted section name, got {at!r}")
    return data, at


def _yaml_text(value: Any) -> str:
    """A YAML scalar / list as the text a command-line override would carry (a list as a JSON array, so that
    items holding commas or edge spaces arrive whole)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps([v if isinstance(v, str) else _yaml_text(v) for v in value])
    return str(value)


def _json_list(text: str) -> list[str] | None:
    """The items of a JSON array (``["a, b", " c"]``: each string exactly as written), or None for other text,
    which is split on commas (``[a,b]``, ``a,b``)."""
    if not text.startswith("["):
        return None
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [v if isinstance(v, str) else json.dumps(v) for v in items]


def _flatten(mapping: dict[str, Any], prefix: str) -> list[str]:
    items = []
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            items.extend(_flatten(value, dotted + "."))
        else:
            items.append(f"{dotted}={_yaml_text(value)}")
    return items


def expand_presets(
    cfg: Any, overrides: Iterable[str], presets_dir: str | os.PathLike, *, renamed: Mapping[str, str] | None = None
) -> list[str]:
    """Replace each ``preset=NAME`` / ``section=@NAME`` by the preset's dotted overrides, in place.

    Each preset is checked against ``cfg`` with the plain overrides given after it, so an error names the
    preset, and a value the preset sets that only a later override makes valid (``rollout.engine=vllm`` where
    vLLM is not installed, overridden by ``rollout.engine=native``) is no error.
    """
    items = list(overrides)
    out: list[str] = []
    for i, item in enumerate(items):
        preset = _preset_reference(item)
        if preset is None:
            out.append(item)
            continue
        name, section = preset
        mapping, at = load_preset(presets_dir, name)
        section = at if section is None else section
        expanded = _flatten(mapping, f"{section}." if section else "")
        later = [o for o in items[i + 1 :] if _preset_reference(o) is None]
        try:
            apply_overrides(cfg, expanded + later, renamed=renamed)
        except ConfigError as e:
            try:
                apply_overrides(cfg, later, renamed=renamed)
            except ConfigError:
                pass  # a later override is wrong on its own: reported when everything is applied
            else:
                raise ConfigError(f"preset {name!r} applied at {section or 'the root'!r}: {e}") from e
        out.extend(expanded)
    return out


def _preset_reference(item: str) -> tuple[str, str | None] | None:
    """``(preset name, section)`` for ``preset=NAME`` (section None: the preset's own ``_at_``) or
    ``section=@NAME``; None for a plain override."""
    key, _, text = item.partition("=")
    key, text = key.strip().lstrip("-"), text.strip()
    if key == "preset":
        return (text[1:] if text.startswith("@") else text), None
    if text.startswith("@"):
        return text[1:], key
    return None


def apply_overrides(
    cfg: Any,
    overrides: Iterable[str],
    *,
    presets_dir: str | os.PathLike | None = None,
    renamed: Mapping[str, str] | None = None,
) -> Any:
    """Return ``cfg`` with each ``dotted.key=value`` override applied, in order.

    With ``presets_dir``, ``preset=NAME`` and ``section=@NAME`` items expand first (see the module doc).
    ``renamed``: old spellings (a key or a section) -> what replaced them; an override of one (on the command line
    or in a preset) is refused with that message, not read as a new key's value.
    """
    overrides = list(overrides)
    if presets_dir is not None:
        overrides = expand_presets(cfg, overrides, presets_dir, renamed=renamed)
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. actor.optim.lr=1e-5)")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        _refuse_renamed(key, renamed)
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


# ---------------------------------------------------------------------------------------------------
# Help: every key with its default and meaning, read from the config classes' own comments.


def field_docs(cls: type) -> dict[str, str]:
    """The one-line meaning of each field of an attrs config class (its bases' fields included), taken
    from the comment after the field (``x: int = 1  #: meaning`` or ``# meaning``) or, failing that, the
    ``#:`` comment lines right above it. Fields without either map to ``""``."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not attrs.has(klass) or klass.__module__ == "builtins":
            continue
        try:
            lines, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        tree = ast.parse(textwrap.dedent("".join(lines)))
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                docs[node.target.id] = _comment_for(lines, node.lineno - 1, node.end_lineno - 1)
    return {f.name: docs.get(f.name, "") for f in attrs.fields(cls)}


def _comment_for(lines: list[str], first: int, last: int) -> str:
    tokens = _tokenize_safe(lines[last].strip())
    trailing = [t.string for t in tokens if t.type == tokenize.COMMENT] if first == last else []
    if not trailing and last != first:  # a field over several lines: its last line's comment
        trailing = [t.string for t in tokens if t.type == tokenize.COMMENT]
    if trailing:
        return trailing[-1].lstrip("#").lstrip(":").strip()
    above = []
    i = first - 1
    while i >= 0 and lines[i].strip().startswith("#:"):
        above.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return " ".join(above)


def _tokenize_safe(line: str) -> list:
    """The tokens of one source line (``[]`` when it does not tokenize on its own, e.g. an open bracket)."""
    try:
        return list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError):
        return []


def config_rows(cfg: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default as given on the command line, meaning)`` for every key of ``cfg``."""
    rows = []
    docs = field_docs(type(cfg))
    for name, f in _fields(type(cfg)).items():
        value = getattr(cfg, name)
        if attrs.has(type(value)):
            rows.extend(config_rows(value, f"{prefix}{name}."))
        else:
            rows.append((prefix + name, _default_text(value), docs.get(name, "")))
    return rows


def _default_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(_default_text(v) for v in value) if value else "(empty)"
    if value == "":
        return "(empty)"
    return str(value)


def config_help(cfg: Any) -> str:
    """``--help`` text: one line per key, ``key = default  meaning``."""
    rows = config_rows(cfg)
    width = min(max(len(f"{k} = {d}") for k, d, _ in rows), 56)
    return "\n".join(f"  {f'{k} = {d}':<{width}}  {m}" for k, d, m in rows)


def recipe_help(
    doc: str,
    cfg: Any,
    *,
    presets_dir: str | os.PathLike | None = None,
    registries: Mapping[str, Iterable[str]] | None = None,
) -> str:
    """A recipe's ``--help``: its docstring, every key (:func:`config_help`), every preset under ``presets_dir``
    and, whole, the names each key of ``registries`` takes (``{"algo.estimator": names, ...}``)."""
    parts = [doc.rstrip(), "", "config keys (key = default: meaning):", config_help(cfg)]
    if presets_dir is not None:
        parts += [
            "",
            "presets (preset=<name>, or <section>=@<name> for one section):",
            *textwrap.wrap(
                ", ".join(available_presets(presets_dir)) or "none", 116, initial_indent="  ", subsequent_indent="  "
            ),
        ]
    if registries:
        parts += [
            "",
            "the names of the built-ins (a key that takes a function also takes your own, as "
            "package.module:function or path/to/file.py:function):",
        ]
        for key, names in registries.items():
            parts += textwrap.wrap(
                ", ".join(names), 116, initial_indent=f"  {key}: ", subsequent_indent="    ", break_on_hyphens=False
            )
    return "\n".join(parts)


def config_markdown(cfg: Any) -> str:
    """The keys of ``cfg`` as a Markdown table (key, default, meaning), for the docs."""
    out = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, meaning in config_rows(cfg):
        default = default.replace("|", "\\|")
        out.append(f"| `{key}` | `{default}` | {meaning.replace('|', '/')} |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# Function-valued keys: a built-in name or a reference to a function in a module or a file.


def resolve_function(
    spec: str,
    builtins: Mapping[str, Callable[..., Any]],
    key: str,
    *,
    aliases: Mapping[str, str] | None = None,
) -> Callable[..., Any]:
    """The callable that the config value ``spec`` of ``key`` names.

    - a name of ``builtins`` (or of ``aliases``, which maps other spellings to those names);
    - ``package.module:function``: imported with ``importlib.import_module`` (the module must be
      importable, e.g. installed or on ``PYTHONPATH``);
    - ``path/to/file.py:function``: the file loaded as a module (relative paths from the working dir).

    ``function`` may be dotted (``module:Class.method``). Code is imported, never evaluated. Every
    failure is a :class:`ConfigError` naming ``key`` and what is wrong.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"{key} is empty; give one of the built-ins ({', '.join(builtins)}) or a reference "
            "'package.module:function' / 'path/to/file.py:function'"
        )
    spec = spec.strip()
    if ":" not in spec:
        name = (aliases or {}).get(spec, spec)
        if name in builtins:
            return builtins[name]
        close = difflib.get_close_matches(spec, [*builtins, *(aliases or {})], n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"{key}={spec!r} is not a built-in name{hint} (built-ins: {', '.join(builtins)}); a function of your "
            "own is given as 'package.module:function' or 'path/to/file.py:function'"
        )
    where, _, attr_path = spec.rpartition(":")
    if not where or not attr_path:
        raise ConfigError(
            f"{key}={spec!r}: a reference looks like 'package.module:function' or 'path/to/file.py:function'"
        )
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    module = _load_file(where, key, spec) if is_file else _import_module(where, key, spec)
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            source = f"file {where!r}" if is_file else f"module {where!r}"
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{key}={spec!r}: {source} has no attribute {attr_path!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r}: {attr_path!r} is a {type(obj).__name__}, not a callable")
    return obj


def _import_module(name: str, key: str, spec: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(
                f"{key}={spec!r}: no module named {e.name!r}{_close_modules(e.name)} (is it installed "
                "or on PYTHONPATH?)"
            ) from None
        raise ConfigError(f"{key}={spec!r}: importing module {name!r} failed: {e}") from e
    except Exception as e:  # the module's own code failed: say which key brought it in
        raise ConfigError(f"{key}={spec!r}: importing module {name!r} failed: {type(e).__name__}: {e}") from e


def _close_modules(missing: str) -> str:
    """ "; did you mean ..." for a module name that does not import: the closest modules beside it."""
    import pkgutil

    parent, _, last = missing.rpartition(".")
    try:
        found = pkgutil.iter_modules(importlib.import_module(parent).__path__) if parent else pkgutil.iter_modules()
        names = [m.name for m in found]
    except Exception:  # noqa: BLE001 - the parent does not import either, or is no package: no suggestion
        return ""
    close = difflib.get_close_matches(last, names, n=3, cutoff=0.7)
    return f"; did you mean {', '.join(f'{parent}.{c}' if parent else c for c in close)}?" if close else ""


def _load_file(path_text: str, key: str, spec: str) -> types.ModuleType:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        siblings = [p.name for p in path.parent.glob("*.py")] if path.parent.is_dir() else []
        close = difflib.get_close_matches(path.name, siblings, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(str(path.parent / c) for c in close)}?" if close else ""
        raise ConfigError(f"{key}={spec!r}: no file {path}{hint}")
    # one module per file (re-resolving returns the same functions), under a name no import can collide with
    module_name = f"_config_ref_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{key}={spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # attrs / dataclasses in the file look their module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ConfigError(f"{key}={spec!r}: loading {path} failed: {type(e).__name__}: {e}") from e
    return module


def main(argv: list[str] | None = None) -> None:
    """``python -m backends.config package.module:Config``: that config's keys as a Markdown table;
    ``python -m backends.config --update BUILD.md``: regenerate every ``<!-- keys: ... -->`` table in a file."""
    import argparse
    import re

    parser = argparse.ArgumentParser(description="Print a recipe config's keys (default, meaning) as a Markdown table.")
    parser.add_argument("config", nargs="?", help="the config class, e.g. experiments.grpo:Config")
    parser.add_argument(
        "--update", metavar="FILE", help="rewrite the key tables between <!-- keys: NAME --> markers in FILE"
    )
    args = parser.parse_args(argv)
    if args.update:
        path = Path(args.update)

        def table(match: re.Match) -> str:
            name = match.group(1)
            return f"<!-- keys: {name} -->\n{config_markdown(resolve_function(name, {}, 'config')())}\n<!-- /keys -->"

        path.write_text(re.sub(r"<!-- keys: (\S+) -->\n.*?<!-- /keys -->", table, path.read_text(), flags=re.S))
        return
    if not args.config:
        parser.error("give a config class or --update FILE")
    print(config_markdown(resolve_function(args.config, {}, "config")()))


if __name__ == "__main__":
    main()
