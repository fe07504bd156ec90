"""The hook protocol of recipes: a paper's method as a plug-in of the RL run.

A method that needs more than a pure tensor function of `mcore_rl.algos` (state across steps, its
own engines, a decision after the weight sync, a repair of rollout groups) is one module in
`mcore_rl/recipes/`, a subclass of `Recipe` listed once in `mcore_rl/recipes/registry.py: RECIPES`.
The core (`runtime/loop.py`, `runtime/rollouts.py`, `train/rl_step.py`, `config/rl_validate.py`)
calls the hooks of the active recipes in registration order and names
none of them; `tests/test_import_rules.py` keeps it so. The core finds the recipes through
`registered()`, which imports the registration module by name, as a plug-in entry point would
(the same upward arrow as the names config validation reads from the registries).

Each hook has a default that does nothing, so a recipe overrides only where it acts. Where the
hooks run, in the order of one RL step (see docs/architecture.md, "Recipes"):

* `check(cfg, errors)` (class method; every registered recipe, active or not): its config keys,
  before any worker starts, with the key named in each error.
* `setup(run)` (every rank, after the weights are loaded, before the engines start) and
  `engines_ready(run)` (rank 0, once the engine pool exists, before the rollout manager).
* Rollout side (rank 0, the scheduler's, in both schedules): `co_samples` / `co_submit` (a second
  source of samples: the first `co_samples(step, G)` samples of a training group come from it),
  `repair_round` (each round of scored groups: the synchronous schedule's rounds, or one group
  as it finishes in the streaming one), `observe_round` (what a round ended as), `finish_batch`
  (the batch handed to the learner), `rollout_metrics`, `stale_ok` (a sample old by design).
* `batch_step(samples, run)` (every rank, after the batch is broadcast, before the learner).
* Learner (every rank): `behaviour_logp` (the μ the mismatch correction sees) and
  `learner_metrics`.
* `before_update()`, `after_optimizer(run, step)` (before the step's weight sync),
  `after_sync(run, learner)`, `after_eval(rl_step, metrics)` (may end the run), `summary()`.
* `state_key` / `state_dict` / `load_state_dict`: its state in the checkpoint's `rl` section, and
  `close()`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Sequence

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import RLConfig
    import torch

    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.rollout.pool import Generation, GenRequest

RECIPES_MODULE = "mcore_rl.recipes.registry"  # where the recipes are registered (its RECIPES tuple)


class RolloutContext(Protocol):
    """What the rollout-side hooks may use: the run's config, the training stream's sampling, and
    the engines and rewards of the scheduler's event loop (`runtime/rollouts.py: PoolBackend`)."""

    cfg: Any

    @property
    def tokenizer(self) -> Any: ...

    @property
    def temperature(self) -> float: ...

    def budget(self, prompt: Prompt) -> int: ...

    def sampling_params(
        self, temperature: float, seed: int | None, max_new_tokens: int | None = None, domain: str | None = None
    ) -> dict[str, Any]: ...

    async def generate_many(self, requests: Sequence[GenRequest]) -> list[Generation]: ...

    async def score_rewards(self, samples: list[Sample]) -> None: ...


class Recipe:
    """A method of a paper as a plug-in of the run; every hook defaults to doing nothing."""

    name: str = ""
    state_key: str | None = None  # key of its state in the checkpoint's `rl` section (None: stateless)
    source: str | None = None  # `Sample.source` of the samples its `co_submit` generates

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        """Whether the recipe acts in a run of `cfg`."""
        return False

    @classmethod
    def check(cls, cfg: RLConfig, errors: Any) -> None:
        """Config rules of its keys (`config.rules.Errors`), checked for every run."""

    # ------------------------------------------------------------------ setup

    def setup(self, run: Any) -> None:
        """Every rank, after the weights are loaded (or resumed), before the engines start."""

    def engines_ready(self, run: Any) -> None:
        """Rank 0: the engine pool exists; start what the recipe needs besides it."""

    # ------------------------------------------------------------------ rollout side (rank 0)

    def co_samples(self, step: int, group_size: int) -> int:
        """How many samples of a training group of `group_size` this recipe generates at `step`."""
        return 0

    def co_submit(self, requests: list) -> Any:
        """Start generating `requests`; returns an object whose `result()` is their `Generation`s."""
        raise NotImplementedError(f"recipe {self.name!r} generates no samples")

    async def repair_round(
        self, groups: list[list[Sample]], rollout: RolloutContext
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """One round of scored training groups (on the scheduler's event loop): (groups, counts
        added to `rollout/repair/*`)."""
        return groups, {}

    def observe_round(self, groups: list[list[Sample]]) -> dict[str, float]:
        """The round's groups after every repair; values set in `rollout/repair/*`."""
        return {}

    def finish_batch(
        self, groups: list[list[Sample]], rollout: RolloutContext
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """The batch the learner gets: (groups, counts added to `rollout/repair/*`)."""
        return groups, {}

    def rollout_metrics(self, groups: list[list[Sample]], step: int) -> dict[str, float]:
        return {}

    def stale_ok(self, sample: Sample) -> bool:
        """True for a sample that is older than `rollout.max_staleness` by design."""
        return False

    # ------------------------------------------------------------------ every rank

    def batch_step(self, samples: Sequence[Sample], run: Any) -> dict[str, float]:
        """After the batch is broadcast, before the learner (e.g. reward heads from judges' info)."""
        return {}

    def behaviour_logp(
        self, samples: Sequence[Sample], rollout_logp: torch.Tensor, old_logp: torch.Tensor
    ) -> torch.Tensor:
        """The [N, T] μ the mismatch correction sees (default: the engines' log-probs, as given)."""
        return rollout_logp

    def learner_metrics(
        self,
        samples: Sequence[Sample],
        old_logp: torch.Tensor,
        rollout_logp: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor,
        seq_advantages: torch.Tensor,
        valid: torch.Tensor,
    ) -> dict[str, float]:
        return {}

    def before_update(self) -> None:
        """Before the learner's optimizer steps of a batch."""

    def after_optimizer(self, run: Any, step: int) -> dict[str, float]:
        """After the batch's optimizer steps (`step` updates done), before the step's weight sync."""
        return {}

    def after_sync(self, run: Any, learner: Any) -> dict[str, float]:
        """After the step's weight sync (collective)."""
        return {}

    def after_eval(self, rl_step: int, metrics: dict[str, float]) -> tuple[dict[str, float], str | None]:
        """After an evaluation: (metrics, a reason to end the run here or None)."""
        return {}, None

    def summary(self) -> dict[str, Any]:
        """What `run_rl`'s summary reports about the recipe."""
        return {}

    # ------------------------------------------------------------------ checkpoint, shutdown

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        """Before `setup`'s consumers use it: the state `state_dict` saved."""

    def close(self) -> None:
        """Release what `setup` / `engines_ready` started (every child process dies here)."""


def registered() -> tuple[type[Recipe], ...]:
    """Every registered recipe class, in registration order (the order hooks run in)."""
    return tuple(importlib.import_module(RECIPES_MODULE).RECIPES)


def active(cfg: RLConfig) -> list[Recipe]:
    """One instance of each recipe that acts in a run of `cfg`."""
    return [cls(cfg) for cls in registered() if cls.enabled(cfg)]


def check_all(cfg: RLConfig, errors: Any) -> None:
    """Every registered recipe's config rules."""
    for cls in registered():
        cls.check(cfg, errors)
