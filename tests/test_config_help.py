"""Every recipe key is documented where it is defined, and BUILD.md's key tables are generated from those docs."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from backends.config import config_help, config_markdown, config_rows, field_docs
from experiments import custom_algorithm, grpo, ppo

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "experiments.grpo:Config": grpo.Config,
    "experiments.ppo:Config": ppo.Config,
    "experiments.custom_algorithm:Config": custom_algorithm.Config,
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_key_has_a_default_and_a_meaning(name):
    rows = config_rows(RECIPES[name]())
    undocumented = [key for key, _, meaning in rows if not meaning]
    assert not undocumented, f"document these fields with a `#:` comment: {undocumented}"
    assert len({key for key, _, _ in rows}) == len(rows)


def test_docs_come_from_the_comment_after_or_above_a_field():
    @attrs.frozen
    class Sample:
        a: int = 1  #: after the field
        #: above the field,
        #: over two lines
        b: int = 2
        c: int = 3  # a plain comment counts too
        d: int = 4

    assert field_docs(Sample) == {
        "a": "after the field",
        "b": "above the field, over two lines",
        "c": "a plain comment counts too",
        "d": "",
    }
    text = config_help(Sample())
    assert "a = 1" in text and "after the field" in text


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_build_md_holds_the_current_key_table(name):
    """BUILD.md's table for each recipe is the output of `python -m backends.config <recipe>:Config`."""
    text = (ROOT / "BUILD.md").read_text()
    match = re.search(rf"<!-- keys: {re.escape(name)} -->\n(.*?)\n<!-- /keys -->", text, re.S)
    assert match, f"BUILD.md has no <!-- keys: {name} --> table"
    assert match.group(1).strip() == config_markdown(RECIPES[name]()).strip(), (
        f"BUILD.md's key table for {name} is out of date: "
        f"regenerate it with python -m backends.config --update BUILD.md"
    )


@pytest.mark.parametrize("recipe", [grpo, ppo, custom_algorithm], ids=["grpo", "ppo", "custom_algorithm"])
def test_help_lists_the_presets_and_whole_registries(recipe, capsys):
    """--help names every preset and every built-in a key takes, with no list cut short by "..."."""
    import rlfunc as rf
    from backends.config import available_presets
    from backends.rewards import BUILTIN_REWARDS

    assert recipe.main(["--help"]) == {}
    text = capsys.readouterr().out
    presets = text[text.index("presets (preset=<name>") :]
    assert all(name in presets for name in available_presets(recipe.PRESETS)) and "own_task/tiny" in presets
    names = text[text.index("the names of the built-ins") :]
    assert all(re.search(rf"\b{re.escape(name)}\b", names) for name in BUILTIN_REWARDS)
    if recipe is grpo:
        estimators, _ = grpo.group_estimators()
        assert all(f" {name}," in names or f" {name}\n" in names for name in [*estimators, *rf.POLICY_LOSSES])
        assert all(kind in names for kind in rf.KL_KINDS)
    listed_with_dots = [line for line in text.splitlines() if re.search(r", \.\.\.\)?\s*$|, \.\.\.\)", line)]
    assert not listed_with_dots, listed_with_dots
