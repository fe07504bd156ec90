"""Model families: one module each, registered once in `hf/families.py`, named nowhere else.

Adding a family touches its module and the `FAMILIES` tuple (docs/model_families.md): the shared
config, modeling, weight-name and export code asks the registry and names no family, and what the
converter and exporter accept follows from the registration.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import transformers

from mcore_rl.config.loader import config_to_dict
from mcore_rl.hf import McoreRLConfig
from mcore_rl.hf.families import FAMILIES, STOCK_DECODERS, family_named, family_of, stock_decoder
from mcore_rl.hf.family import ModelFamily, StockDecoder

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


# First words that megatron-core's own names carry (`GPTModel`, `get_gpt_layer_local_spec`): the
# family is then named by its full name, and that name without underscores (`GptOssConfig`).
_SHARED_FIRST_WORDS = ("gpt",)


def _words(family_name: str) -> list[str]:
    """The family's name and its first word (`deepseek_v3` -> also `deepseek`)."""
    first = family_name.split("_")[0]
    if first in _SHARED_FIRST_WORDS:
        return sorted({family_name, family_name.replace("_", "")})
    return sorted({family_name, first})


def _bundle(family: ModelFamily) -> set[str]:
    """A family's files: its reference modeling and HF side, its megatron-core half, and its `model.*`
    keys (a section of `ModelConfig`, torch-free so that loading a config imports no bundle); with those
    of the family it builds on and of the families that build on it (`ModelFamily.builds_on`: they
    share that family's parts and keys)."""
    related = {family.name, family.builds_on} | {f.name for f in FAMILIES if f.builds_on == family.name}
    return {f"{part}/{name}.py" for name in related if name for part in ("hf", "models", "config/model_keys")}


def _keys(family: ModelFamily) -> set[str]:
    """The `model.*` keys of the family's section, or of the one it builds on (config/model_keys:
    FAMILY_SECTIONS)."""
    from mcore_rl.config.model_keys import FAMILY_SECTIONS

    sections = [s for s in FAMILY_SECTIONS if s.cls.family in (family.name, family.builds_on)]
    assert sections, f"{family.name} has no keys' section in config/model_keys"
    return set().union(*(s.yaml_keys() for s in sections))


# The registrations (the family's record, its keys' section), and the one value users write under
# `model:` that names it (`arch`); nothing else outside a bundle.
REGISTRATIONS = ("hf/families.py", "config/model_keys/__init__.py")
ARCH_DECLARATION = "config/schema.py"
# The text formats of a family's chat template (its tool calls), keyed by its model type and named
# as SGLang names its parsers: the agentic runtime's half of a family, which `data/` keeps because it
# may not import `hf/`.
TEXT_FORMATS = "data/tool_calls.py"
# The architectures refused by model_type with what they are (DeepSeek-V3.2 named there is no family).
REFUSED = "hf/refused_architectures.py"


def _code_names(path: pathlib.Path) -> set[str]:
    """Identifiers, attribute and keyword names, imported modules and string constants of a file's
    code, lower-case; docstrings and comments (prose) are left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.update((node.name, node.asname or ""))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return {n.lower() for n in names if n}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_family_is_its_bundle_plus_one_registration(family: ModelFamily) -> None:
    """No code outside the family's two files names it (branches on its name, imports its module)
    or reads its `model.*` keys, but the registration and the keys' declaration: its config
    rules, FLOPs, megatron-core spec and TransformerConfig, weight names and the engine's cache
    layout are hooks of the bundle the shared code calls."""
    words = _words(family.name)
    keys = _keys(family)
    named, read = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in _bundle(family):
            continue
        text = path.read_text().lower()
        if not any(w in text for w in [*words, *keys]):  # a cheap pre-filter: most files name neither
            continue
        code = _code_names(path)
        if rel not in (*REGISTRATIONS, ARCH_DECLARATION, TEXT_FORMATS, REFUSED):
            named += [f"{rel}: {n!r}" for n in sorted(code) if any(w in n for w in words)]
        read += [f"{rel}: {k}" for k in sorted(keys & code)]
    assert named == [], f"code outside {family.name}'s bundle names it: {named}"
    assert read == [], f"code outside {family.name}'s bundle reads its model keys: {read}"
    assert keys, "the family's model keys are its section's (config/model_keys)"


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


@pytest.mark.parametrize("decoder", STOCK_DECODERS, ids=lambda d: d.model_type)
def test_a_stock_decoder_is_its_record(decoder: StockDecoder) -> None:
    """A stock GQA-decoder model type is read and exported by its record alone: the converter
    accepts it, exports to its class, and a stock config of it that says nothing of QK-norm,
    biases, a shared-expert gate or a window translates to what the record says it implies."""
    from mcore_rl.convert.hf_checkpoint import SUPPORTED_MODEL_TYPES
    from mcore_rl.convert.to_hf import STOCK_CLASSES
    from mcore_rl.hf import model_config_from_hf_config

    assert decoder.model_type in SUPPORTED_MODEL_TYPES
    assert STOCK_CLASSES[decoder.model_type] == decoder.stock_class
    assert hasattr(transformers, decoder.stock_class)
    assert stock_decoder(decoder.model_type) is decoder and family_of(McoreRLConfig()) is None
    moe = "moe" in decoder.model_type
    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    if moe:
        sizes.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
    stock = transformers.AutoConfig.for_model(decoder.model_type, **sizes)
    mc = model_config_from_hf_config(stock)
    implied = dict(
        use_qk_norm=("qk_layernorm", decoder.qk_norm),
        qkv_bias=("add_qkv_bias", decoder.qkv_bias),
        shared_expert_gate=("moe_shared_expert_gate", decoder.shared_expert_gate and moe),
    )
    checked = [key for field, (key, value) in implied.items() if not hasattr(stock, field)]
    for field, (key, value) in implied.items():
        if not hasattr(stock, field):  # the stock config is silent: the record says
            assert config_to_dict(mc)[key] == value, key
    assert checked, "the stock config states every field; nothing of the record was read"
    assert (mc.sliding_window == 16) == decoder.windowed


def test_config_knows_which_keys_the_families_own() -> None:
    """Validation skips importing the bundles when no family's section is set: the sections it reads
    (`config/model_keys: FAMILY_SECTIONS`) must be exactly the registered families' (a family with
    rules of its own has one), and no family may be named like the decoder's archs."""
    from mcore_rl.config.model_keys import FAMILY_SECTIONS
    from mcore_rl.config.schema import DECODER_ARCHS

    owners = [s.cls.family for s in FAMILY_SECTIONS]
    assert len(owners) == len(set(owners))
    own_rules = {f.name for f in FAMILIES if f.check_model is not ModelFamily.check_model}
    # a family that builds on another (GLM-4.5 on DeepSeek-V3) uses that one's section
    assert set(owners) == {f.name for f in FAMILIES if f.name in own_rules and not f.builds_on}
    assert all(f.builds_on in owners for f in FAMILIES if f.builds_on)
    assert not {f.name for f in FAMILIES} & set(DECODER_ARCHS)
