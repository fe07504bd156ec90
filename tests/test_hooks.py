"""The hook protocol of recipes (`mcore_rl/hooks.py`) and its one registration (`mcore_rl/recipes/__init__.py`).

Light checks (no megatron, no engine): every recipe module is registered once, the recipes a config
turns on and their order, validation that reaches every registered recipe (also one that is off),
and the error naming the key where a method cannot run in a schedule. The hooks themselves act in
the tests of each method (`test_recipes_polaris.py`, `test_s2l_po.py`, `test_algos_mipu.py`,
`test_distill_learner.py`, `test_remath.py`, `test_algos_filters.py`), through real runs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from mcore_rl import hooks
from mcore_rl.config import ConfigError, validate_rl_config
from tests.helpers import tiny

RECIPES_DIR = pathlib.Path(__file__).resolve().parents[1] / "mcore_rl" / "recipes"


def _recipe_classes_defined() -> set[str]:
    """Class names of `Recipe` subclasses defined in the recipe modules (by their source)."""
    found = set()
    for path in RECIPES_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "Recipe" for b in node.bases):
                found.add(node.name)
    return found


def test_every_recipe_module_is_registered_once_with_a_unique_name_and_state_key():
    classes = hooks.registered()
    assert {c.__name__ for c in classes} == _recipe_classes_defined()  # a recipe not registered never runs
    assert len(set(classes)) == len(classes)
    names = [c.name for c in classes]
    assert all(names) and len(set(names)) == len(names)
    keys = [c.state_key for c in classes if c.state_key is not None]
    assert len(set(keys)) == len(keys)  # each state has its own key in the checkpoint


def test_the_config_picks_the_active_recipes_in_registration_order():
    assert hooks.active(tiny()) == []  # a plain GRPO run: the core calls no recipe
    on = hooks.active(tiny("rollout.gec.enabled=true", "rollout.polaris.rescue=true"))
    assert [r.name for r in on] == ["polaris", "gec"]  # POLARIS rescues before GEC repairs what is still wrong
    mipu = hooks.active(tiny("algorithm.mismatch.name=mipu"))
    assert [r.name for r in mipu] == ["mipu"] and mipu[0].state_key == "mipu"


def test_a_recipe_that_is_off_still_checks_its_keys():
    """Validation reaches every registered recipe, not only the active ones."""
    cfg = tiny("rollout.polaris.rescue_buffer_prompts=0")
    assert not hooks.active(cfg)
    with pytest.raises(ConfigError, match=r"rollout\.polaris\.rescue_buffer_prompts: must be >= 1, got 0"):
        validate_rl_config(cfg, 1)


@pytest.mark.parametrize(
    "override, key",
    [
        ("distill.effopd.enabled=true", "distill.effopd.enabled"),
    ],
)
def test_a_method_the_async_schedule_cannot_run_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError, match=rf"{key.replace('.', r'[.]')}: .*rollout\.runtime=sync"):
        validate_rl_config(tiny("rollout.runtime=async", "rollout.max_staleness=1", override), 1)


def test_mipu_runs_in_both_schedules_at_staleness_0_and_says_why_not_beyond():
    """MIPU's rollback needs that no training sample comes from the update it rolls back."""
    validate_rl_config(tiny("algorithm.mismatch.name=mipu"), 1)
    validate_rl_config(tiny("algorithm.mismatch.name=mipu", "rollout.runtime=async", "rollout.max_staleness=0"), 1)
    with pytest.raises(
        ConfigError,
        match=r"algorithm\.mismatch\.name: mipu accepts or rolls back .* needs "
        r"rollout\.max_staleness=0 \(got 1\)",
    ):
        validate_rl_config(tiny("algorithm.mismatch.name=mipu", "rollout.runtime=async", "rollout.max_staleness=1"), 1)
