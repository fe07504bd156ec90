"""APPO's tree rollouts ("APPO: Agentic Procedural Policy Optimization", USTC & Alibaba, 2026): each
scored training group of N roots (`rollout.group_size`) grows branches from the top-B tokens of
every root by the branching score (`mcore_rl.algos.appo`), up to `rollout.appo.budget` = M rollouts.

A branch at position p of a root continues `prompt + root[:p]` with the engine's current weights:
token p is drawn again, and the branch gets what is left of the prompt's token budget. Its sample's
`prompt.ids` is that whole context (the prefix is the root's, trained once, in the root) and its
response the continuation; its text, which the domain's reward scores against the original prompt,
is the prefix's decoded text followed by the continuation's. It is marked `SampleMarks.branch_of`
(the root's index in the group), which is how `algorithm.advantage: appo` tells the init set from
the branch set. A group of step-wise episodes grows branch episodes instead
(`grow_episode_trees`: the environment reset from the group's seed, the root's turns before the
branch replayed and checked, the turn continued from the root's prefix, the episode played on).

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

import asyncio
from dataclasses import replace
from typing import Any

import torch

from mcore_rl.agent.episodes import Episode, TurnOutput, run_episode
from mcore_rl.agent.groups import EpisodeGroups
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


def _points(rows: list[list[Sample]], b: int, gamma: float, clip: float) -> torch.Tensor:
    """[N, B] flat positions over each row's concatenated responses (an episode's steps in order);
    a row that is lost, or has a sample without μ per token, has none."""
    t = max((sum(len(s.response_ids) for s in row) for row in rows), default=0)
    mu = torch.zeros(len(rows), t, dtype=torch.float64)
    mask = torch.zeros(len(rows), t, dtype=torch.float64)
    for n, row in enumerate(rows):
        ok = all(
            s.reward_error is None and s.finish_reason != "abort" and len(s.rollout_logp) == len(s.response_ids)
            for s in row
        )
        if not ok:
            continue
        k = 0
        for s in row:
            m = len(s.response_ids)
            mu[n, k : k + m] = torch.tensor(s.rollout_logp, dtype=torch.float64)
            mask[n, k : k + m] = torch.tensor(s.trainable or [1] * m, dtype=torch.float64)
            k += m
    return branch_points(branching_scores(mu, mu, -mu, mask, gamma=gamma, clip=clip), mask, b)


def _locate(row: list[Sample], flat: int) -> tuple[int, int]:
    """(step, offset in its response) of a flat position over an episode's steps."""
    for t, s in enumerate(row):
        if flat < len(s.response_ids):
            return t, flat
        flat -= len(s.response_ids)
    raise IndexError("position past the episode's tokens")


def _replayed(step: Sample, stop_ids: Any) -> TurnOutput:
    """A root's turn fed again as it was sampled (its ids, μ and versions); cut by the token cap
    when it does not end in a stop token."""
    ids = list(step.response_ids)
    versions = list(step.token_versions or [step.policy_version] * len(ids))
    finish = "stop" if ids and ids[-1] in stop_ids else "length"
    return TurnOutput(list(ids), list(step.rollout_logp), versions, finish, step.engine, 1)


async def _branch_episode(
    rollout: RolloutContext, ep: Episode, root: list[Sample], t: int, p: int
) -> list[Sample] | None:
    """Replay `root`'s turns before t in `ep`, continue turn t from its first p tokens with the
    engines, play the episode out; its samples from step t on (the prefix untrained), or None if the
    replay did not reach the root's context of turn t (an environment that does not replay)."""
    for u in range(t + 1):
        if ep.done or ep.context_ids() != list(root[u].prompt.ids):
            return None
        if u < t:
            ep.advance(_replayed(root[u], ep.chat.stop_ids))
    step = root[t]
    versions = list(step.token_versions or [step.policy_version] * len(step.response_ids))
    out = TurnOutput(list(step.response_ids[:p]), list(step.rollout_logp[:p]), versions[:p], "abort", step.engine)
    for part in range(1, 65):  # as `episodes.generate_turn`, from the prefix
        req = ep.request(out.ids, part)
        if req is None:
            out.finish_reason = "length"
            break
        out.add((await rollout.generate_many([req]))[0])
        if out.finish_reason != "abort":
            break

    async def generate(r: GenRequest) -> Any:
        return (await rollout.generate_many([r]))[0]

    ep.advance(out)
    await run_episode(ep, generate)
    samples = ep.samples()[t:]
    first = samples[0]
    first.trainable = [0] * p + list(first.trainable or [1] * len(first.response_ids))[p:]
    return samples


async def grow_episode_trees(
    rollout: RolloutContext, group: list[Sample], episodes: EpisodeGroups, counts: dict[str, int]
) -> list[Sample]:
    """The branches of a group of step-wise episodes: a branch at token p of step t of a root episode
    is a new episode of the group's environment, reset from the group's seed, the root's turns before
    t replayed (each step's context checked against the root's), turn t continued from its first p
    tokens and the episode played on by the engines. Its samples are its steps from t on, the
    prefix of step t untrained (it is the root's); each carries the branch episode's return."""
    cfg, a = rollout.cfg, rollout.cfg.rollout.section(APPOConfig)
    by_episode: dict[int, list[Sample]] = {}
    for s in group:
        by_episode.setdefault(int(s.episode or 0), []).append(s)
    keys = sorted(by_episode)
    rows = [sorted(by_episode[j], key=lambda s: s.step_index or 0) for j in keys]
    points = _points(rows, a.branch_points, a.gamma, a.clip)
    plan = allot_branches(points, total_rollouts(cfg, len(rows)) - len(rows))
    prompt = rows[0][0].prompt

    async def one(k: int, n: int, flat: int) -> list[Sample]:
        t, p = _locate(rows[n], flat)
        seed = sample_seed(cfg.train.seed, SALT_APPO, prompt.index, len(rows) + k)
        sp = rollout.sampling_params(rollout.temperature, seed, None, prompt.domain)
        (ep,) = episodes.episodes(prompt, [sp])
        ep.index = max(keys) + 1 + k
        try:
            samples = await _branch_episode(rollout, ep, rows[n], t, p)
        finally:
            ep.close()
        if samples is None:
            counts["replay_mismatch"] += 1
            return []
        counts["branches"] += 1
        counts["prefix_tokens"] += p
        counts["context_tokens"] += len(samples[0].prompt.ids) + p
        for s in samples:
            s.marks = SampleMarks(branch_of=keys[n])
        return samples

    done = await asyncio.gather(*(one(k, n, f) for k, (n, f) in enumerate(plan)))
    return [s for branch in done for s in branch]


COUNTS = ("branches", "no_room", "prefix_tokens", "context_tokens", "replay_mismatch")


async def grow_trees(
    rollout: RolloutContext, groups: list[list[Sample]], episodes: EpisodeGroups | None = None
) -> tuple[list[list[Sample]], dict[str, int]]:
    """Every group's branches (module docstring), scored by the domain's reward: (groups, counts).
    A group of step-wise episodes grows through `episodes` (`grow_episode_trees`)."""
    cfg = rollout.cfg
    a = cfg.rollout.section(APPOConfig)
    tokenizer = rollout.tokenizer
    counts = dict.fromkeys(COUNTS, 0)
    plans: list[tuple[int, int, int, list[int], GenRequest]] = []  # (group, root, position, context, request)
    grown_episodes: dict[int, list[Sample]] = {}
    for gi, roots in enumerate(groups):
        if roots and roots[0].episode is not None:
            if episodes is None:
                raise RuntimeError("rollout.appo: a group of episodes, and no environments to replay them in")
            grown_episodes[gi] = await grow_episode_trees(rollout, roots, episodes, counts)
            continue
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
    grown = [list(g) + grown_episodes.get(gi, []) for gi, g in enumerate(groups)]
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
                d.agent is None,
                f"data.domains[{i}].agent",
                f"rollout.appo cannot branch domain {d.name!r}: an agent program's episode cannot be replayed",
            )
            errors.need(
                d.environment is None or d.environment.trajectory == "stepwise",
                f"data.domains[{i}].environment.trajectory",
                f"rollout.appo branches episodes of step-wise samples only; domain {d.name!r} is 'conversation' "
                "(a branch would need the trajectory cut inside a sample, not built)",
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

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        self.episodes: EpisodeGroups | None = None  # the environments branches of episodes replay in

    async def repair_round(
        self, groups: list[list[Sample]], rollout: RolloutContext
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        if self.episodes is None and self.cfg.data.domains:
            self.episodes = EpisodeGroups.from_config(self.cfg, rollout.tokenizer)
        groups, counts = await grow_trees(rollout, groups, self.episodes)
        return groups, {f"appo_{k}": float(v) for k, v in counts.items()}

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
