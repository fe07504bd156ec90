"""docs/configuration.md is generated from the schema (`mcore_rl/config/reference.py`): it must equal
what the generator writes now, and every key must have its line of help (a field comment)."""

from pathlib import Path

from mcore_rl.config.reference import ROOTS, field_comments, render, walk
from mcore_rl.config.schema import OptimizerConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_reference_is_up_to_date():
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is stale: python -m mcore_rl.config.reference > docs/configuration.md"
    )


def test_every_key_has_help():
    missing = [f"{cmd}: {k.path}" for cmd, root in ROOTS for k in walk(root) if not k.help]
    assert not missing, f"schema fields without a help comment: {missing}"


def test_help_comes_from_the_field_comment_and_defaults_from_the_parent():
    keys = {k.path: k for k in walk(ROOTS[1][1])}
    assert keys["optimizer.lr"].default == "`0.0001`"  # RLConfig overrides OptimizerConfig's 1e-3
    assert keys["rollout.group_size"].help == "G samples per prompt"
    assert keys["data.domains[].rewards[].weight"].type == "float"
    # a comment block above a field counts when the field has none on its own line
    assert "LR-decay baseline" in field_comments(OptimizerConfig)["lr_decay_style"]
