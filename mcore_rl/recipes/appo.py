"""APPO's tree rollouts ("APPO: Agentic Procedural Policy Optimization", USTC & Alibaba, 2026): each
scored training group of N roots (`rollout.group_size`) grows branches from the top-B tokens of
every root by the branching score (`mcore_rl.algos.appo`), up to `rollout.appo.budget` = M rollouts.

A branch at position p of a root continues `prompt + root[:p]` with the engine's current weights:
token p is drawn again, and the branch gets what is left of the prompt's token budget. Its sample's
`prompt.ids` is that whole context (the prefix is the root's, trained once, in the root) and its
response the continuation; its text, which the domain's reward scores against the original prompt,
is the prefix's decoded text followed by the continuation's. It is marked `SampleMarks.branch_of`
(the root's index in the group), which is how `algorithm.advantage: appo` tells the init set from
the branch set.

The score's inputs, as the rollout has them:

* ρ = π_θ / π_old: the branches are drawn right after their roots, by the weights that drew them,
  so ρ ≡ 1 and the Ω factor is constant and drops out (`branching_scores`). Across an asynchronous
  weight sync the roots would need rescoring by the new weights; that is not done (docs/step_credit.md).
* H_i: the engines return no full-vocabulary entropy, so the sampled token's surprisal −log μ(y_i)
  stands in for it — an unbiased one-sample estimate of the entropy at temperature 1 (μ are the raw
  log-probs), a noisy one per token.

Prefix reuse: `rollout/repair/appo_prefix_tokens` over `appo_context_tokens` is the share of the
branches' context an engine with a prefix cache (SGLang's radix cache) serves from the roots' K/V;
the embedded engine has no prefix cache and computes every context in full.
"""

from __future__ import annotations

from dataclasses import replace
import torch

from mcore_rl.algos.appo import allot_branches, branch_points, branching_scores
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.config.rules import Errors
from mcore_rl.data.samples import Sample, SampleMarks
from mcore_rl.hooks import Recipe, RolloutContext
from mcore_rl.recipes.config.appo import APPOConfig
from mcore_rl.rollout.pool import GenRequest
from mcore_rl.runtime.rollout_manager import sample_seed

SALT_APPO = 5  # sampling seeds of the branches (apart from the rollout's salts 1-3 and GEC's 4)


def root_points(roots: list[Sample], b: int, gamma: float, clip: float) -> torch.Tensor:
    """[N, B] long: each root's branch positions in its response, best first (-1: none); a root
    without tokens, aborted or without a reward has none."""
    t = max((len(s.response_ids) for s in roots), default=0)
    mu = torch.zeros(len(roots), t, dtype=torch.float64)
    mask = torch.zeros(len(roots), t, dtype=torch.float64)
    for n, s in enumerate(roots):
        if s.reward_error is None and s.finish_reason != "abort" and len(s.rollout_logp) == len(s.response_ids):
            mu[n, : len(s.response_ids)] = torch.tensor(s.rollout_logp, dtype=torch.float64)
            mask[n, : len(s.response_ids)] = 1.0
    scores = branching_scores(mu, mu, -mu, mask, gamma=gamma, clip=clip)
    return branch_points(scores, mask, b)


def total_rollouts(cfg: RLConfig, n: int) -> int:
    """M for a group of `n` roots: `rollout.appo.budget`, or N + N·B."""
    a = cfg.rollout.section(APPOConfig)
    return a.budget if a.budget > 0 else n + n * a.branch_points


async def grow_trees(rollout: RolloutContext, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, int]]:
    """Every group's branches (module docstring), scored by the domain's reward: (groups, counts)."""
    cfg = rollout.cfg
    a = cfg.rollout.section(APPOConfig)
    tokenizer = rollout.tokenizer
    counts = {"branches": 0, "no_room": 0, "prefix_tokens": 0, "context_tokens": 0}
    plans: list[tuple[int, int, int, list[int], GenRequest]] = []  # (group, root, position, context, request)
    for gi, roots in enumerate(groups):
        points = root_points(roots, a.branch_points, a.gamma, a.clip)
        for k, (n, p) in enumerate(allot_branches(points, total_rollouts(cfg, len(roots)) - len(roots))):
            s = roots[n]
            context = s.prompt.ids + list(s.response_ids[:p])
            room = min(
                rollout.budget(s.prompt) - p,
                cfg.train.seq_length - len(context),
                cfg.rollout.context_length - len(context),
            )
            if room < 1:
                counts["no_room"] += 1
                continue
            seed = sample_seed(cfg.train.seed, SALT_APPO, s.prompt.index, len(roots) + k)
            sp = rollout.sampling_params(rollout.temperature, seed, room, s.prompt.domain)
            plans.append((gi, n, p, context, GenRequest(context, sp)))
    gens = await rollout.generate_many([r for *_, r in plans]) if plans else []
    grown = [list(g) for g in groups]
    new: list[Sample] = []
    for (gi, n, p, context, _), gen in zip(plans, gens):
        root = groups[gi][n]
        if len(gen.output_logprobs) != len(gen.output_ids):
            raise RuntimeError(
                f"engine {gen.engine} returned {len(gen.output_logprobs)} log-probs for {len(gen.output_ids)} tokens"
            )
        branch = Sample(
            replace(root.prompt, ids=context),
            root.group,
            list(gen.output_ids),
            list(gen.output_logprobs),
            gen.weight_version,
            gen.finish_reason,
            tokenizer.decode(list(root.response_ids[:p])) + gen.text,
            gen.engine,
            token_versions=list(gen.output_versions) if gen.output_versions is not None else None,
            marks=SampleMarks(branch_of=n),
        )
        grown[gi].append(branch)
        new.append(branch)
        counts["branches"] += 1
        counts["prefix_tokens"] += len(context) - len(root.prompt.ids)
        counts["context_tokens"] += len(context)
    if new:
        await rollout.score_rewards(new)
    return grown, counts


class TreeRollouts(Recipe):
    """APPO's branches on every round of scored training groups (after POLARIS and GEC)."""

    name = "appo"

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        return cfg.rollout.section(APPOConfig).enabled

    @classmethod
    def check(cls, cfg: RLConfig, errors: Errors) -> None:
        a, key = cfg.rollout.section(APPOConfig), "rollout.appo"
        if not a.enabled:
            errors.need(
                cfg.algorithm.advantage != "appo",
                "algorithm.advantage",
                "'appo' compares the init and branch sets of tree rollouts; set rollout.appo.enabled: true",
            )
            return
        errors.need(a.branch_points >= 1, f"{key}.branch_points", f"must be >= 1, got {a.branch_points}")
        n = cfg.rollout.group_size
        errors.need(
            a.budget == 0 or a.budget > n,
            f"{key}.budget",
            f"must be 0 (N + N·B) or more than the {n} roots (rollout.group_size), got {a.budget}",
        )
        errors.need(0.0 < a.gamma <= 1.0, f"{key}.gamma", f"must be in (0, 1], got {a.gamma}")
        errors.need(0.0 < a.clip < 1.0, f"{key}.clip", f"must be in (0, 1), got {a.clip}")
        errors.need(
            cfg.algorithm.advantage == "appo",
            "algorithm.advantage",
            f"rollout.appo grows tree rollouts; their dual-group advantage is 'appo', got {cfg.algorithm.advantage!r}",
        )
        for i, d in enumerate(cfg.data.domains):
            errors.need(
                d.environment is None and d.agent is None,
                f"data.domains[{i}].environment" if d.environment is not None else f"data.domains[{i}].agent",
                f"rollout.appo branches single-turn responses only; domain {d.name!r} is multi-turn "
                "(branching an episode mid-turn needs its environment replayed, not built)",
            )
        errors.need(
            cfg.algorithm.routing_replay != "r3",
            key,
            "branches carry no engine routing of their prefix; use algorithm.routing_replay r2 or none",
        )
        errors.need(
            not cfg.rollout.sampling_mask_replay,
            key,
            "branches are drawn without asking for their sampling masks (not wired); turn off "
            "rollout.sampling_mask_replay",
        )

    async def repair_round(
        self, groups: list[list[Sample]], rollout: RolloutContext
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        groups, counts = await grow_trees(rollout, groups)
        return groups, {f"appo_{k}": float(v) for k, v in counts.items()}
