"""The code layout is the architecture: imports point one way, and every module and function stays small.

Reads the imports of our own packages (``rlfunc``, ``backends``, ``experiments``; not the tests, not
third-party modules) with ``ast``, so nothing is imported or run. Imports inside functions count too: a
lazy import is still a dependency.

Layers, lowest first; a module may import its own layer's group and any lower layer, never a higher one:

    rlfunc  <  backends.{config, metrics_log, models, packing, data, rewards, cpu}  <  backends.distributed
            <  backends.checkpoint  <  backends.training | backends.rollout  <  backends.loop  <  experiments

``backends.training`` and ``backends.rollout`` are siblings that never import each other (weights travel
between them as a state dict, through ``backends.loop.weight_bridge``, the one layer that sees both).
Outside ``backends/cpu`` only the package's seam (``from backends.cpu import tune_process``) is used, never
its submodules.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlfunc", "backends", "experiments")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
RLFUNC_THIRD_PARTY = {"torch", "attrs", "einops"}

# (layer, group): an import must go to a lower layer, or stay inside its own group
LAYERS = (
    ("rlfunc", (0, "rlfunc")),
    ("backends.config", (1, "base")),
    ("backends.metrics_log", (1, "base")),
    ("backends.models", (1, "base")),
    ("backends.packing", (1, "base")),
    ("backends.data", (1, "base")),
    ("backends.rewards", (1, "base")),
    ("backends.cpu", (1, "base")),
    ("backends.distributed", (2, "distributed")),
    ("backends.checkpoint", (3, "checkpoint")),
    ("backends.training", (4, "training")),
    ("backends.rollout", (4, "rollout")),
    ("backends.loop", (5, "loop")),
    ("experiments", (6, "experiments")),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _imports(name: str, path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, imported module, imported name or None)`` for every import of our packages in ``path``."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names if _ours(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not _ours(base):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:  # `from pkg import module`
                    out.append((node.lineno, submodule, None))
                else:
                    out.append((node.lineno, base, alias.name))
    return out


EDGES = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> tuple[int, str]:
    for prefix, layer in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return layer
    if name == "backends":
        return (1, "base")
    raise AssertionError(f"module {name} is in no layer of tests/test_layout.py: add it to LAYERS")


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(REPO)}:{line}"


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_imports_point_down_the_layers():
    wrong = []
    for name, imports in EDGES.items():
        mine = _layer(name)
        for line, target, _ in imports:
            theirs = _layer(target)
            if theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1]):
                wrong.append(f"{_where(name, line)}: {name} {mine} imports {target} {theirs}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_cpu_settings_are_reached_only_through_their_seam():
    wrong = [
        f"{_where(name, line)}: {name} imports {target}; use `from backends.cpu import <seam>`"
        for name, imports in EDGES.items()
        if not name.startswith("backends.cpu")
        for line, target, _ in imports
        if target.startswith("backends.cpu.")
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_another_modules_private_names():
    wrong = [
        f"{_where(name, line)}: {name} imports {target}.{imported}"
        for name, imports in EDGES.items()
        for line, target, imported in imports
        if imported is not None and imported.startswith("_") and target != name
    ]
    wrong += [
        f"{_where(name, line)}: {name} imports the private module {target}"
        for name, imports in EDGES.items()
        for line, target, _ in imports
        if any(part.startswith("_") and part != "__init__" for part in target.split("."))
    ]
    assert not wrong, "give a shared helper one public home:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    graph = {
        name: {target for _, target, _ in imports if target in MODULES and target != name}
        for name, imports in EDGES.items()
    }
    # a package's __init__ that re-exports its own submodules is not a cycle with them
    for name in graph:
        if _is_package(name):
            graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_rlfunc_imports_only_torch_attrs_einops():
    wrong = []
    for name, path in MODULES.items():
        if not name.startswith("rlfunc"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = []
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = [node.module.split(".")[0]]
            for root in roots:
                if root not in RLFUNC_THIRD_PARTY | {"rlfunc", "__future__"} | set(sys.stdlib_module_names):
                    wrong.append(f"{_where(name, node.lineno)}: imports {root}")
                if root in {"importlib", "os", "io", "pathlib", "socket", "subprocess", "threading"}:
                    wrong.append(f"{_where(name, node.lineno)}: imports {root} (no I/O or processes in the pure core)")
    # importlib.metadata is the one standard way to read the installed version
    wrong = [w for w in wrong if not ("rlfunc/__init__.py" in w and "importlib" in w)]
    assert not wrong, "\n".join(wrong)


def test_modules_stay_small():
    big = [
        f"{path.relative_to(REPO)}: {n} lines"
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not big, f"split modules over {MAX_MODULE_LINES} lines into one idea each:\n" + "\n".join(big)


def _recipe(name: str) -> bool:
    return name.startswith("experiments.") and name.count(".") == 1


#: the RL step's work, done by the loop (backends/loop) alone: a recipe that calls one of these runs a step of its own
STEP_CALLS = frozenset(
    {
        "update",
        "update_actor",
        "update_critic",
        "compute_logprobs",
        "own_rows_logprobs",
        "compute_values",
        "generate",
        "sample",
        "sample_and_score",
        "sample_share",
        "sync",
        "sync_weights",
        "sync_adapter",
        "release_memory",
        "full_state_dict",
        "broadcast_weights",
        "save_checkpoint",
        "load_checkpoint",
    }
)
#: the modules that hold the step's pieces; a recipe reaches them only through the loop
STEP_MODULES = (
    "backends.rollout",
    "backends.training.roles",
    "backends.training.engines",
    "backends.checkpoint",
    "backends.distributed.weight_broadcast",
    "backends.distributed.sample_channel",
    "backends.loop.colocated",
    "backends.loop.split",
    "backends.loop.learner",
    "backends.loop.sampling",
    "backends.loop.weight_bridge",
)


def _step_work(name: str, tree: ast.AST) -> list[str]:
    """The calls of the step's work and the imports of its modules in recipe module ``name``'s ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if called in STEP_CALLS:
                found.append(f"{name}:{node.lineno}: calls {called}() (the loop's step does)")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(STEP_MODULES):
            found.append(f"{name}:{node.lineno}: imports {node.module} (reach it through backends.loop.rl_loop)")
    return found


def test_recipes_do_not_run_the_step():
    """The step exists in one place (backends/loop): a recipe hands the loop an algorithm and never updates an
    engine, samples, syncs weights or checkpoints itself."""
    wrong = [
        w for name, path in MODULES.items() if _recipe(name) for w in _step_work(name, ast.parse(path.read_text()))
    ]
    assert not wrong, "\n".join(wrong)


def test_functions_stay_short():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{_where(name, node.lineno)}: {node.name} is {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


# a past session's anecdotes ("session 14's machine"), not the multi-turn session API
STAND_ALONE = re.compile(r"\bsession \d+|session's machine|this machine|PLATFORM\.md|\.\./shared", re.IGNORECASE)
DOC_PATHS = ("README.md", "BUILD.md", "Makefile", "rlfunc", "backends", "experiments", "benchmarks")


def _text_files():
    for entry in DOC_PATHS:
        path = REPO / entry
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in paths:
            if "__pycache__" in p.parts or p.suffix in {".pyc", ".so", ".safetensors", ".png"}:
                continue
            yield p


@pytest.mark.parametrize("path", list(_text_files()), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_and_code_stand_alone(path):
    """No run history or machine anecdotes, and nothing that points outside the repository."""
    hits = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()[:120]}"
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if STAND_ALONE.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_the_checks_find_what_they_look_for(tmp_path):
    """The cycle finder and the layer rule flag a planted cycle and an upward import."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    planted = ast.parse(
        "from backends.rollout.api import build_rollout\nactor, m = engine.update(actor, b, f)\n"
        "rollout = bridge.sync(rollout, engine, actor, version=1)\nrf.grpo(scores, group_ids=g)\n"
    )
    assert _step_work("experiments.mine", planted) == [
        "experiments.mine:1: imports backends.rollout.api (reach it through backends.loop.rl_loop)",
        "experiments.mine:2: calls update() (the loop's step does)",
        "experiments.mine:3: calls sync() (the loop's step does)",
    ]
    assert _layer("backends.training.fsdp") == (4, "training")
    assert _layer("backends.rollout.native")[0] == _layer("backends.training.fsdp")[0]
    assert _layer("backends.cpu.runtime") < _layer("backends.distributed.setup")
