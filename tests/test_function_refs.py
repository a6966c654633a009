"""backends.config.resolve_function: a built-in name or a module / file reference, with clear errors."""

import math
import textwrap

import pytest

import rlfunc as rf
from backends.config import ConfigError, resolve_function

BUILTINS = {"double": lambda x: 2 * x, "square": lambda x: x * x}


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_builtin_name_and_alias():
    assert resolve_function("double", BUILTINS, "algo.fn")(3) == 6
    assert resolve_function("twice", BUILTINS, "algo.fn", aliases={"twice": "double"})(3) == 6


def test_rlfunc_registries_resolve_by_name():
    estimator = resolve_function(
        "grpo", rf.ADVANTAGE_ESTIMATORS, "algo.estimator", aliases=rf.ADVANTAGE_ESTIMATOR_ALIASES
    )
    assert estimator is rf.ADVANTAGE_ESTIMATORS["grpo"]
    assert resolve_function("vanilla", rf.POLICY_LOSSES, "algo.policy_loss") is rf.POLICY_LOSSES["vanilla"]


def test_module_reference():
    assert resolve_function("math:sqrt", BUILTINS, "algo.fn") is math.sqrt
    assert resolve_function("os.path:join", BUILTINS, "algo.fn")("a", "b").endswith("b")
    assert resolve_function("pathlib:Path.cwd", BUILTINS, "algo.fn") is not None  # a dotted attribute


def test_file_reference(tmp_path):
    path = _write(
        tmp_path / "my_estimators.py",
        """
        import attrs

        @attrs.frozen
        class Scale:  # attrs needs the module registered while the file loads
            k: float = 3.0

        def triple(x):
            return Scale().k * x
    """,
    )
    fn = resolve_function(f"{path}:triple", BUILTINS, "algo.fn")
    assert fn(2) == 6.0
    assert resolve_function(f"{path}:triple", BUILTINS, "algo.fn") is fn  # one module per file


def test_relative_file_reference(tmp_path, monkeypatch):
    _write(tmp_path / "mine.py", "def one():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_function("mine.py:one", BUILTINS, "algo.fn")() == 1
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "two.py", "def two():\n    return 2\n")
    assert resolve_function("sub/two.py:two", BUILTINS, "algo.fn")() == 2


def test_unknown_name_lists_the_builtins():
    with pytest.raises(ConfigError) as e:
        resolve_function("dobule", BUILTINS, "algo.estimator")
    message = str(e.value)
    assert "algo.estimator='dobule' is not a built-in name" in message
    assert "did you mean double" in message and "built-ins: double, square" in message
    assert "package.module:function" in message


def test_empty_value():
    with pytest.raises(ConfigError, match="algo.estimator is empty"):
        resolve_function("  ", BUILTINS, "algo.estimator")


def test_missing_module():
    with pytest.raises(ConfigError, match=r"algo.fn='no_such_pkg.mod:f': no module named 'no_such_pkg'"):
        resolve_function("no_such_pkg.mod:f", BUILTINS, "algo.fn")


def test_module_whose_code_fails_names_the_key(tmp_path, monkeypatch):
    _write(tmp_path / "broken_mod.py", "raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"algo.fn='broken_mod:f': importing module 'broken_mod' failed: RuntimeError: boom"
    ):
        resolve_function("broken_mod:f", BUILTINS, "algo.fn")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="algo.fn=.*: no file .*nope.py"):
        resolve_function(f"{tmp_path / 'nope.py'}:f", BUILTINS, "algo.fn")


def test_file_whose_code_fails(tmp_path):
    path = _write(tmp_path / "bad.py", "1 / 0\n")
    with pytest.raises(ConfigError, match="loading .*bad.py failed: ZeroDivisionError"):
        resolve_function(f"{path}:f", BUILTINS, "algo.fn")


def test_missing_attribute(tmp_path):
    with pytest.raises(ConfigError, match=r"algo.policy_loss='math:no_such': module 'math' has no attribute 'no_such'"):
        resolve_function("math:no_such", BUILTINS, "algo.policy_loss")
    path = _write(tmp_path / "est.py", "def f():\n    pass\n")
    with pytest.raises(ConfigError, match=r"file .*est.py' has no attribute 'g'"):
        resolve_function(f"{path}:g", BUILTINS, "algo.fn")


def test_not_callable(tmp_path):
    with pytest.raises(ConfigError, match=r"algo.fn='math:pi': 'pi' is a float, not a callable"):
        resolve_function("math:pi", BUILTINS, "algo.fn")
    path = _write(tmp_path / "consts.py", "SCALE = [1, 2]\n")
    with pytest.raises(ConfigError, match="'SCALE' is a list, not a callable"):
        resolve_function(f"{path}:SCALE", BUILTINS, "algo.fn")


def test_malformed_reference():
    with pytest.raises(ConfigError, match="a reference looks like"):
        resolve_function("math:", BUILTINS, "algo.fn")
    with pytest.raises(ConfigError, match="a reference looks like"):
        resolve_function(":f", BUILTINS, "algo.fn")
