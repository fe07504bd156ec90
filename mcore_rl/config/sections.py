"""Config sections a recipe, a model family or a model feature owns: its dataclass, registered under a
key of a core section.

A recipe's keys are a dataclass of the recipe (`mcore_rl/recipes/config/`), a model family's or
feature's (DeepSeek-V3's MLA and router, MoE, LatentMoE, AttnRes, n-gram embeddings) one of
`mcore_rl/config/model_keys/`, not fields of the core schema. Each registers a `Section`: the core
dataclass whose YAML mapping holds its keys (`owner`), and either the key of its own mapping
(`rollout.<method>: {...}`, `model.ngram: {...}`) or, with `flat`, the prefix its keys carry among the
owner's own (`algorithm.mismatch.<method>_<field>`; the empty prefix keeps them under their own names,
`model.q_lora_rank`). The loader accepts registered sections like fields, refuses any other key with
the same message, and builds every registered section of an owner (its defaults where the config
sets nothing) into the owner's `sections`; code reads one typed, `cfg.rollout.section(TheRecipesConfig)`,
`cfg.model.section(DeepSeekV3Config)`. The configuration reference lists their keys where they sit in
the YAML.

The registrations are read from `SECTIONS_MODULES`, imported by name when a config is loaded, as
`hooks.registered()` finds the recipes: config sits above the recipes in the data flow and imports
none of them, and the model's sections import the schema they hang under. Those modules import
nothing heavy (no torch), so loading a config stays as cheap as before.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, Self, TypeVar, cast, runtime_checkable

# each module's SECTIONS tuple: the model's sections (families, features), then every recipe's
SECTIONS_MODULES = ("mcore_rl.config.model_keys", "mcore_rl.recipes.config")
SECTIONS_FIELD = "sections"  # metadata flag of the owners' field that holds them (not a YAML key)

T = TypeVar("T")


@dataclass(frozen=True)
class Section:
    """One owner's keys in the config tree."""

    owner: type  # the core dataclass whose YAML mapping holds the keys
    # the section's own key (`<method>`), or with flat the prefix of its keys (`<method>_`; "" = none)
    key: str
    cls: type  # the owner's dataclass (every field with a default)
    flat: bool = False  # the fields sit among the owner's own keys, each as key + field name
    help: str = ""  # the reference's line for a nested section (default: the class docstring's first sentence)

    def yaml_keys(self) -> dict[str, str]:
        """YAML key -> the field of `cls` it sets (flat sections; a nested one is its one key)."""
        if not self.flat:
            return {}
        return {self.key + f.name: f.name for f in dataclasses.fields(self.cls) if f.init}


@dataclass
class Sectioned:
    """A core config dataclass that holds registered sections (the base of their owners)."""

    # the sections by class, built by the loader; one that is missing is made with its defaults (in the
    # repr too: two configs that differ only in a section's keys print differently)
    sections: dict[type, object] = field(default_factory=dict, kw_only=True, metadata={SECTIONS_FIELD: True})

    def __post_init__(self) -> None:
        """Every registered section present (its defaults where none was given), in a dict of this
        config's own (a `dataclasses.replace` copy does not share it), so configs compare by them too."""
        given = self.sections
        order = [s.cls for s in sections_of(type(self))]
        unknown = [cls.__name__ for cls in given if cls not in order]
        if unknown:
            raise TypeError(f"{type(self).__name__} has no registered section {', '.join(unknown)}")
        self.sections = {cls: given[cls] if cls in given else cls() for cls in order}

    def section(self, cls: type[T]) -> T:
        """The section `cls` of this config (its defaults unless the config set it)."""
        value = self.sections.get(cls)
        if value is None:
            value = self.sections[cls] = cls()
        return cast(T, value)

    def with_sections(self, *values: object) -> Self:
        """A copy with these sections in place of its own:
        `ModelConfig(num_layers=2).with_sections(MoEConfig(num_experts=4))`."""
        return dataclasses.replace(self, sections={**self.sections, **{type(v): v for v in values}})


def registered() -> tuple[Section, ...]:
    """Every registered section, in registration order."""
    return tuple(s for module in SECTIONS_MODULES for s in importlib.import_module(module).SECTIONS)


def sections_of(owner: type) -> tuple[Section, ...]:
    """The sections whose keys sit in `owner`'s mapping (none for a class that is not `Sectioned`)."""
    if not (isinstance(owner, type) and issubclass(owner, Sectioned)):
        return ()
    return tuple(s for s in registered() if issubclass(owner, s.owner))


def is_sections_field(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(SECTIONS_FIELD))


def walk_sections(cfg: object) -> Iterator[object]:
    """Every registered section of a config tree, each owner's in registration order."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return
    for f in dataclasses.fields(cfg):
        if is_sections_field(f):
            continue
        value = getattr(cfg, f.name)
        for item in value if isinstance(value, list) else [value]:
            yield from walk_sections(item)
    if isinstance(cfg, Sectioned):
        for s in sections_of(type(cfg)):
            yield cfg.section(s.cls)


@runtime_checkable
class ValidationDemand(Protocol):
    """A section whose recipe draws prompts from the run's validation stream."""

    def validation_prompts_needed(self) -> int: ...


def validation_prompts_needed(cfg: object) -> int:
    """The most prompts any section of `cfg` draws from the validation stream (0: none does)."""
    return max(
        (s.validation_prompts_needed() for s in walk_sections(cfg) if isinstance(s, ValidationDemand)), default=0
    )
