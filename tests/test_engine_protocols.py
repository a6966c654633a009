"""Engines are interfaces: every registered engine implements its Protocol, and no code outside an engine's own
modules asks which engine it has.

- Each training engine of :data:`backends.training.engines.TRAIN_ENGINES` is a
  :class:`~backends.training.engine.TrainEngine` (``isinstance`` through ``runtime_checkable``), and each of
  its methods has the protocol's parameters (names, kinds, which have defaults, in order); an engine may add
  keyword-only parameters with defaults. The same for each rollout engine of
  :data:`backends.rollout.api.ROLLOUT_ENGINES`: its state class is a
  :class:`~backends.rollout.engine.RolloutEngine`, its session class a :class:`~backends.rollout.engine.Session`.
- Outside an engine's home (its modules, :data:`HOMES`) nothing compares a value with the engine's name
  (``== "vllm"``, ``in ("fsdp", ...)``), nor tests or dispatches on its classes (``isinstance(x, VLLMRollout)``,
  ``singledispatch.register(NativeRollout, ...)``). Read with ``ast``: nothing is imported for this part.

Cost: about a second (a tiny model for the native engine's instances).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import attrs
import pytest
import torch

from backends.rollout.api import ROLLOUT_ENGINES
from backends.rollout.common import SamplingConfig
from backends.rollout.engine import RolloutEngine, Session
from backends.rollout.environments import MultiTurnConfig
from backends.training.engine import TrainEngine
from backends.training.engines import TRAIN_ENGINES, select_engine

REPO = Path(__file__).resolve().parents[1]
#: engine name -> the module prefix of its home: ``backends.rollout.vllm`` covers vllm.py and vllm_*.py
HOMES = {
    "fsdp": "backends.training.fsdp",
    "megatron": "backends.training.megatron",
    "native": "backends.rollout.native",
    "vllm": "backends.rollout.vllm",
}
#: classes that belong to one engine (its states, sessions and engine objects)
ENGINE_CLASSES = {
    "fsdp": {"FSDPEngine", "TrainState"},
    "megatron": {"MegatronEngine", "MegatronState"},
    "native": {"NativeRollout", "NativeSession", "NativeTurnStream", "NativeRequestStream"},
    "vllm": {"VLLMRollout", "VLLMSession", "VLLMTurnStream", "VLLMRequestStream"},
}


def _protocol_methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def _signature_problems(protocol: type, cls: type, *, inherited_ok: tuple[str, ...] = ()) -> list[str]:
    """How ``cls``'s methods differ from ``protocol``'s (empty: they fit)."""
    problems = []
    for name in _protocol_methods(protocol):
        own = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if own is None or (own is protocol and name not in inherited_ok):
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        want = list(inspect.signature(getattr(protocol, name)).parameters.values())
        have = list(inspect.signature(getattr(cls, name)).parameters.values())
        extra = have[len(want) :]
        shape = lambda params: [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in params]
        if shape(have[: len(want)]) != shape(want):
            problems.append(
                f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} is not "
                f"{protocol.__name__}.{name}{inspect.signature(getattr(protocol, name))}"
            )
        elif any(p.kind != p.KEYWORD_ONLY or p.default is inspect.Parameter.empty for p in extra):
            problems.append(f"{cls.__name__}.{name} adds parameters that are not keyword-only with a default")
    return problems


@pytest.mark.parametrize("name", sorted(TRAIN_ENGINES))
def test_every_training_engine_implements_the_protocol(name):
    engine = select_engine(name)
    assert isinstance(engine, TrainEngine)
    assert engine.name == name and isinstance(engine.runs_on_a_pool, bool) and isinstance(engine.trains_lora, bool)
    assert not _signature_problems(TrainEngine, type(engine), inherited_ok=("sample_shard", "replica_samples"))


@pytest.fixture(scope="module")
def native_instances():
    from backends.models import TinyModelConfig, build_tiny_model
    from backends.rollout.native import NativeRollout

    cfg = TinyModelConfig(
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
    )
    rollout = NativeRollout(model=build_tiny_model(cfg).eval(), pad_token_id=0, eos_token_ids=(1,), max_context=32)
    session = rollout.start_session([[5, 6]], SamplingConfig(n=1), seed=0, max_slots=4)
    yield rollout, session
    session.end()


def _instances(name: str, native_instances) -> tuple[object, object]:
    """A state and a session of engine ``name``, built without starting the engine (vLLM's ``llm`` is a stand-in:
    only the classes' methods are under test here)."""
    if name == "native":
        return native_instances
    spec = ROLLOUT_ENGINES[name]
    from backends.rollout.vllm import VLLMConfig

    if name == "vllm_server":  # clients of no server: only the class's methods are under test
        return spec.engine_type(clients=(), pad_token_id=0, eos_token_ids=(1,), max_context=32, vocab_size=64), None
    state = spec.engine_type(
        llm=object(),
        config=VLLMConfig(),
        pad_token_id=0,
        eos_token_ids=(1,),
        max_context=32,
        vocab_size=64,
        can_sleep=False,
    )
    session = spec.session_type(
        rollout=state, sampling=SamplingConfig(), seed=0, max_slots=4, prompt_lengths=(2,), tokens=[[5, 6]]
    )
    return state, session


@pytest.mark.parametrize("name", sorted(ROLLOUT_ENGINES))
def test_every_rollout_engine_and_session_implements_the_protocols(name, native_instances):
    spec = ROLLOUT_ENGINES[name]
    state, session = _instances(name, native_instances)
    assert type(state) is spec.engine_type and isinstance(state, RolloutEngine)
    assert not _signature_problems(RolloutEngine, spec.engine_type)
    if spec.session_type is None:  # no multi-turn sessions: refused when the config is read
        with pytest.raises(ValueError, match="no multi-turn sessions"):
            spec.check_config(attrs.evolve(_rollout_config(name), multi_turn=MultiTurnConfig(max_turns=2)))
        return
    assert type(session) is spec.session_type and isinstance(session, Session)
    assert not _signature_problems(Session, spec.session_type)
    assert isinstance(spec.weight_dtype(_rollout_config(name)), torch.dtype)


def _rollout_config(name: str):
    """The rollout config that picks engine ``name`` (skipped where the engine's package is not installed)."""
    from backends.rollout.api import RolloutConfig

    try:
        return RolloutConfig(engine=name)
    except ValueError as e:
        pytest.skip(f"rollout.engine={name} is refused here: {e}")


@pytest.mark.parametrize(
    "protocol,module,name",
    [
        ("TurnStream", "backends.rollout.native_turns", "NativeTurnStream"),
        ("TurnStream", "backends.rollout.vllm_turns", "VLLMTurnStream"),
        ("RequestStream", "backends.rollout.native_requests", "NativeRequestStream"),
        ("RequestStream", "backends.rollout.vllm_stream", "VLLMRequestStream"),
    ],
)
def test_every_engine_stream_implements_its_protocol(protocol, module, name):
    """The optional abilities the agent loop and a rollout server look for (start_turn_stream,
    start_request_stream): each engine's stream has the protocol's methods and properties."""
    import importlib

    from backends.rollout import engine as protocols

    wanted, cls = getattr(protocols, protocol), getattr(importlib.import_module(module), name)
    assert not _signature_problems(wanted, cls)
    properties = [k for k, v in vars(wanted).items() if isinstance(v, property)]
    assert properties and all(hasattr(cls, k) or k in _instance_attributes(cls) for k in properties), properties


def _instance_attributes(cls: type) -> set[str]:
    """The attributes ``cls.__init__`` assigns on ``self`` (a property of a protocol may be a plain attribute)."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for t in (t.elts if isinstance(t, ast.Tuple) else [t])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_the_signature_check_finds_a_wrong_method():
    class Wrong(TrainEngine):
        def update(self, state, batch, loss_fn, with_entropy=False):  # positional, and no skip_rows
            return state, {}

    problems = _signature_problems(TrainEngine, Wrong, inherited_ok=("sample_shard", "replica_samples"))
    assert any("Wrong.update" in p for p in problems) and any("Wrong.build_actor is missing" in p for p in problems)


# ---------------------------------------------------------------------------------------------- name tests


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _at_home(module: str, engine: str) -> bool:
    home = HOMES[engine]
    return module == home or module.startswith(home + ".") or module.startswith(home + "_")


def _constants(node: ast.AST) -> list[str]:
    """The string constants ``node`` is or holds (a literal tuple / list / set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _constants(e)]
    return []


def _class_names(node: ast.AST) -> set[str]:
    """The class names ``node`` refers to (a name, ``module.Name``, or a tuple of them)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Tuple):
        return {n for e in node.elts for n in _class_names(e)}
    return set()


def engine_name_tests(source: str, module: str) -> list[tuple[int, str, str]]:
    """``(line, engine, what)`` for every place in ``source`` (module ``module``) that tests an engine's name or
    class outside that engine's home."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for engine in {c for c in _constants(side) if c in HOMES}:
                    found.append((node.lineno, engine, f"compares with {engine!r}"))
        elif isinstance(node, ast.Call):
            fn = node.func
            called = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if called in ("isinstance", "issubclass", "register") and len(node.args) >= 1:
                target = node.args[1] if called != "register" and len(node.args) > 1 else node.args[0]
                for engine, classes in ENGINE_CLASSES.items():
                    if _class_names(target) & classes:
                        names = ", ".join(sorted(_class_names(target) & classes))
                        found.append((node.lineno, engine, f"{called}(..., {names})"))
    return [(line, engine, what) for line, engine, what in found if not _at_home(module, engine)]


def name_tests_in(root: Path) -> list[str]:
    """Every engine-name test of ``root``'s ``backends`` and ``experiments`` packages, as ``path:line: what``."""
    out = []
    for package in ("backends", "experiments"):
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(path, root)
            out += [
                f"{path.relative_to(root)}:{line}: {what}"
                for line, _, what in engine_name_tests(path.read_text(), module)
            ]
    return out


def test_nothing_outside_an_engines_home_tests_its_name():
    found = name_tests_in(REPO)
    assert not found, "use the engine's methods, feature flags or registry instead:\n" + "\n".join(found)


def test_the_name_scan_finds_what_it_looks_for():
    planted = (
        'if cfg.engine == "vllm" or backend in ("fsdp", "x"):\n    pass\n'
        "ok = isinstance(r, rollout_native.NativeRollout)\nf.register(VLLMRollout, g)\n"
    )
    found = engine_name_tests(planted, "experiments.recipe")
    assert sorted(engine for _, engine, _ in found) == ["fsdp", "native", "vllm", "vllm"]
    # vLLM's own module may test its own name, not another's
    assert engine_name_tests(planted.split("\n")[0] + "\n    pass\n", "backends.rollout.vllm_session") == [
        (1, "fsdp", "compares with 'fsdp'")
    ]
