"""Model families: one module each, registered once in `hf/families.py`, named nowhere else.

Adding a family touches its module and the `FAMILIES` tuple (docs/architectures.md): the shared
config, modeling, weight-name and export code asks the registry and names no family, and what the
converter and exporter accept follows from the registration.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import transformers

from mcore_rl.hf import McoreRLConfig
from mcore_rl.hf.families import FAMILIES, family_named, family_of
from mcore_rl.hf.family import ModelFamily

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mcore_rl"
# The shared code every family goes through; none of it may name one.
SHARED_FILES = (
    "hf/configuration.py",
    "hf/modeling.py",
    "hf/layers.py",
    "hf/weight_map.py",
    "convert/to_hf.py",
    "convert/hf_checkpoint.py",
)


def _words(family_name: str) -> list[str]:
    """The family's name and its first word (`deepseek_v3` -> also `deepseek`)."""
    return sorted({family_name, family_name.split("_")[0]})


@pytest.mark.parametrize("name", SHARED_FILES)
def test_shared_code_names_no_family(name: str) -> None:
    text = (PACKAGE / name).read_text().lower()
    named = [w for f in FAMILIES for w in _words(f.name) if re.search(rf"\b{re.escape(w)}", text)]
    assert named == [], f"mcore_rl/{name} names {named}: move it into the family's module (hf/family.py)"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_registration_is_all_the_shared_code_needs(family: ModelFamily) -> None:
    from mcore_rl.convert.hf_checkpoint import SUPPORTED_MODEL_TYPES
    from mcore_rl.convert.to_hf import FP32_TENSORS, STOCK_CLASSES

    assert family.stock_model_type in SUPPORTED_MODEL_TYPES
    assert STOCK_CLASSES[family.stock_model_type] == family.stock_class
    assert hasattr(transformers, family.stock_class)
    assert FP32_TENSORS.get(family.stock_model_type, ()) == family.fp32_tensors
    assert family_named(family.name) is family
    # our config carries the family's fields with their defaults, and finds its family by them
    ours = McoreRLConfig(family=family.name)
    assert family_of(ours) is family
    assert {k: getattr(ours, k) for k in family.config_fields} == family.config_fields
    assert family_of(McoreRLConfig()) is None


def test_unknown_family_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"family='gpt2': expected one of qwen3, " + FAMILIES[0].name):
        McoreRLConfig(family="gpt2")
