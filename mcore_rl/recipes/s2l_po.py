"""S2L-PO ("Smaller Models are Natural Explorers for Policy-Level Diversity in GRPO", THU & CUHK,
ICML 2026): during the first T_mix steps a frozen smaller model on its own engines (`rollout.explorer`,
`rollout/explorer.py`) writes the first ⌈α_t·G⌉ samples of every training group (α_t from the
registered "explorer_schedule", `algos/s2l_po.py`); plain GRPO runs on the merged group.

Its samples are marked `source="explorer"` and carry the small model's μ; their weight version is
the policy's (the batch trains at it) and their engine `explorer@<url>`. The learner's mismatch
correction sees, on those rows, the small model's μ (`correction: explorer_logp`) or π_old
(`none`: IS weight 1), and the run logs how far they are from π_old and the advantages they get.
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Sequence

import numpy as np
import torch

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl import algos
from mcore_rl.algos.mismatch import mismatch_metrics
from mcore_rl.algos.multi_reward import OptionError
from mcore_rl.algos.policy_loss import masked_mean
from mcore_rl.algos.s2l_po import behaviour_logp, explorer_share
from mcore_rl.config.rl_validate import check_engine_group
from mcore_rl.config.rules import Errors, need_registered
from mcore_rl.data.samples import Sample
from mcore_rl.recipes.config.s2l_po import ExplorerConfig
from mcore_rl.hooks import Recipe
from mcore_rl.rollout.explorer import Explorer, build_explorer

SOURCE = "explorer"  # `Sample.source` of the explorer's samples


def explorer_learner_metrics(
    explorer: torch.Tensor,
    old: torch.Tensor,
    mu: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    seq_advantages: torch.Tensor,
    valid: torch.Tensor,
) -> dict[str, float]:
    """How far the explorer's samples are from π_old (K3 against the small model's μ), the IS
    weight they train with, and their mean advantage next to the policy's samples' ("pushed down as
    negatives"?)."""
    rows = explorer[:, None].to(mask.dtype)
    out = {k.replace("mismatch/", "explorer/", 1): float(v) for k, v in mismatch_metrics(old, mu, mask * rows).items()}
    out["explorer/is_weight_mean"] = float(masked_mean(weights.float(), mask * rows))
    ours, theirs = explorer & valid, ~explorer & valid
    out["explorer/advantage_mean"] = float(seq_advantages[ours].mean()) if bool(ours.any()) else 0.0
    out["explorer/policy_advantage_mean"] = float(seq_advantages[theirs].mean()) if bool(theirs.any()) else 0.0
    return out


def _rows(samples: Sequence[Sample]) -> torch.Tensor:
    return torch.tensor([s.source == SOURCE for s in samples], dtype=torch.bool)


class SmallModelExplorer(Recipe):
    """The explorer's engines (rank 0), its share of each training group, its learner-side μ."""

    name = "s2l_po"
    source = SOURCE

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        self.explorer: Explorer | None = None

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        return cfg.rollout.section(ExplorerConfig).enabled

    @classmethod
    def check(cls, cfg: RLConfig, errors: Errors) -> None:
        """Servers or a checkpoint (not both), a schedule that is registered and accepts `share` /
        `mix_steps`, no routing replay. Reachability and the tokenizer are
        checked when the trainer connects (`rollout/explorer.py`)."""
        x, key = cfg.rollout.section(ExplorerConfig), "rollout.explorer"
        if not x.enabled:
            return
        errors.need(
            not (x.urls and x.model_path),
            f"{key}.urls",
            "the explorer needs either urls (running servers) or model_path (engines the trainer starts), got both",
        )
        check_engine_group(x, key, bool(x.model_path), errors)
        if need_registered(
            errors, f"{key}.schedule", "explorer schedule", x.schedule, algos.names("explorer_schedule")
        ):
            try:
                algos.get("explorer_schedule", x.schedule)(0, 1, mix_steps=x.mix_steps, share=x.share)
            except OptionError as err:
                errors.need(False, f"{key}.{err.option}", err.message)
        errors.need(
            cfg.algorithm.routing_replay != "r3",
            key,
            "routing replay r3 replays the engine's experts, and the explorer's are not the policy's; "
            "use algorithm.routing_replay r2 or none",
        )

    def engines_ready(self, run: Any) -> None:
        """The frozen smaller model's engines, checked before training."""
        cfg = self.cfg
        self.explorer = build_explorer(
            cfg.rollout.section(ExplorerConfig),
            cfg.rollout,
            run.tokenizer,
            os.path.join(cfg.run_dir, "engines"),
            cfg.train.seed,
            tokenizer_path=cfg.data.tokenizer_path,
        )

    def co_samples(self, step: int, group_size: int) -> int:
        if self.explorer is None:
            return 0
        x = self.cfg.rollout.section(ExplorerConfig)
        return int(algos.get("explorer_schedule", x.schedule)(step, group_size, mix_steps=x.mix_steps, share=x.share))

    def co_submit(self, requests: list) -> Any:
        assert self.explorer is not None
        return self.explorer.submit(requests)

    def rollout_metrics(self, groups: list[list[Sample]], step: int) -> dict[str, float]:
        """α of this step, the explorer's share of the batch, and each source's mean reward."""
        if self.explorer is None:
            return {}
        x = self.cfg.rollout.section(ExplorerConfig)
        flat = [s for g in groups for s in g]
        ours = [s.reward for s in flat if s.source == SOURCE]
        theirs = [s.reward for s in flat if s.source != SOURCE]
        out = {
            "explorer/alpha": explorer_share(step, mix_steps=x.mix_steps, share=x.share),
            "explorer/samples_frac": len(ours) / max(len(flat), 1),
        }
        if ours:
            out["explorer/reward_mean"] = float(np.mean(ours))
        if theirs:
            out["explorer/policy_reward_mean"] = float(np.mean(theirs))
        return out

    def behaviour_logp(
        self, samples: Sequence[Sample], rollout_logp: torch.Tensor, old_logp: torch.Tensor
    ) -> torch.Tensor:
        return behaviour_logp(
            rollout_logp, old_logp, _rows(samples), self.cfg.rollout.section(ExplorerConfig).correction
        )

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
        rows = _rows(samples)
        if not bool(rows.any()):
            return {}
        return explorer_learner_metrics(rows, old_logp, rollout_logp, mask, weights, seq_advantages, valid)

    def close(self) -> None:
        if self.explorer is not None:
            self.explorer.close()
