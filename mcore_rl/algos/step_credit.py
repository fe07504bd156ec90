"""Step-level credit for multi-turn episodes: the one input every step-level estimator shares.

A step-wise environment domain (`environment.trajectory: stepwise`) gives one sample per step of
each episode; the G episodes of a prompt's group start from one seeded state. An episode-level
estimator (GRPO) gives every step of an episode the episode's advantage; a step-level one compares
steps with each other, by the state they acted in (GiGPO, HGPO, GAGPO) or by a critic (StepPO). They
are kind "advantage" estimators with one more input, `steps`: a `StepBatch` of [N] tensors saying
where each sample sits in its episode. The learner passes it to the estimators whose signature names
it (`multi_reward.OPTIONAL_INPUTS`), so `algorithm.advantage: gigpo` picks one like any estimator,
and validation refuses one on a batch that has no steps to compare (a single-turn domain, or a
conversation-form environment, which gives one sample per episode).

The conventions every estimator here follows:

* An episode is (group id, `episode`); its samples are ordered by `step`. A sample that is not a
  step of an episode (`episode` -1) is an episode of one step with a state of its own.
* A step's reward r_t is the environment's reward for that step (invalid-turn penalties included).
  The sample's `rewards` value (the episode's return, after reward shaping) minus the sum of its
  episode's step rewards is added to the last step's reward, so the undiscounted return of step 0
  is the reward the episode-level estimators use (`effective_step_rewards`).
* The return of step t is R_t = Σ_{u>=t} γ^{u-t} r_u over the episode's steps (`step_returns`).
* States are compared by `state_key`, a stable 63-bit hash of the environment's state text
  (`state_key`), within one group only: two groups never share an anchor state.
* A statistic over a set of steps counts only the valid samples (`valid`); a set with fewer than
  2 valid samples gives advantage 0, as `advantages.py` does for groups. Every estimator takes a
  set's mean and std from one helper, `moments_within` (or `normalized_within` over it).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from mcore_rl.algos.advantages import grpo, valid_mask
from mcore_rl.algos.multi_reward import group_moments, need

STEPS_INPUT = "steps"  # the name of the input in an estimator's signature


@dataclass(frozen=True)
class StepBatch:
    """Where each sample of a batch sits in its episode, each [N] in the batch's order.

    `episode`: its episode within its group (`Sample.episode`; -1: not a step of an episode);
    `step`: its step in the episode (`Sample.step_index`); `state_key`: `state_key()` of the state
    it acted in; `step_reward`: the environment's reward for that step."""

    episode: torch.Tensor
    step: torch.Tensor
    state_key: torch.Tensor
    step_reward: torch.Tensor

    def check(self, n: int) -> None:
        for name in ("episode", "step", "state_key", "step_reward"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n,):
                raise ValueError(f"steps.{name} {shape} must be [{n}] (one per sample)")


def state_key(state: str) -> int:
    """A stable 63-bit key of a state text (the same in every process and run, unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(state.encode(), digest_size=8).digest(), "little") >> 1


def takes_steps(fn: Callable) -> bool:
    """Is `fn` a step-level estimator (does its signature name the `steps` input)?"""
    return STEPS_INPUT in inspect.signature(fn).parameters


def steps_of(steps: StepBatch | None, rewards: torch.Tensor) -> StepBatch:
    """`steps` checked against the batch; None (a batch without episodes) as N episodes of one step,
    each in a state of its own — where every step-level estimator here has its stated limit (GiGPO
    is GRPO, HGPO and GAGPO are 0). Validation refuses a step-level estimator on such a run."""
    n = rewards.shape[0]
    if steps is None:
        none = torch.full((n,), -1, dtype=torch.long)
        return StepBatch(none, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), rewards.double())
    steps.check(n)
    return steps


def dense_ids(keys: Sequence[Hashable]) -> torch.Tensor:
    """[N] long: equal keys get equal ids 0..K-1, in order of first appearance."""
    table: dict[Hashable, int] = {}
    return torch.tensor([table.setdefault(k, len(table)) for k in keys], dtype=torch.long)


def episodes(group_ids: torch.Tensor, steps: StepBatch) -> list[list[int]]:
    """Each episode's sample indices in step order (a sample outside an episode is one of its own)."""
    by_key: dict[tuple[str, int, int], list[int]] = {}
    ep, gid, st = steps.episode.tolist(), group_ids.tolist(), steps.step.tolist()
    for i in range(len(ep)):
        key = ("episode", gid[i], ep[i]) if ep[i] >= 0 else ("single", i, 0)
        by_key.setdefault(key, []).append(i)
    return [sorted(ix, key=lambda i: st[i]) for ix in by_key.values()]


def effective_step_rewards(rewards: torch.Tensor, group_ids: torch.Tensor, steps: StepBatch) -> torch.Tensor:
    """[N] float64: each step's reward, its episode's remainder (the last step's `rewards` minus the
    sum of the episode's step rewards) added to the episode's last step."""
    r = steps.step_reward.double().clone()
    total = rewards.double()
    for ix in episodes(group_ids, steps):
        last = ix[-1]
        r[last] += total[last] - r[ix].sum()
    return r


def next_index(group_ids: torch.Tensor, steps: StepBatch) -> list[int]:
    """For each sample, the sample of its episode's next step (-1 after the last)."""
    out = [-1] * group_ids.shape[0]
    for ix in episodes(group_ids, steps):
        for a, b in zip(ix, ix[1:]):
            out[a] = b
    return out


def discounted(values: torch.Tensor, group_ids: torch.Tensor, steps: StepBatch, factor: float) -> torch.Tensor:
    """[N] float64: x_t + factor^{t'-t} · (the same at the episode's next step t'), from the last step
    back — the return for rewards and γ, GAE for TD residuals and γλ."""
    out = values.double().clone()
    st = steps.step.tolist()
    for ix in episodes(group_ids, steps):
        for a, b in zip(reversed(ix[:-1]), reversed(ix[1:])):
            out[a] = out[a] + factor ** (st[b] - st[a]) * out[b]
    return out


def gae(
    rewards: torch.Tensor, group_ids: torch.Tensor, steps: StepBatch, values: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """[N] float64: GAE over each episode's steps, Â_t = δ_t + γλ Â_{t+1} with δ_t = r_t + γ V_{t+1} − V_t
    (r: `effective_step_rewards`; V [N]: the value of each step's state; 0 after the last step)."""
    v = values.double()
    nxt = torch.tensor(next_index(group_ids, steps), dtype=torch.long)
    following = torch.where(nxt >= 0, v[nxt.clamp_min(0)], torch.zeros((), dtype=torch.float64))
    gap = torch.where(nxt >= 0, steps.step[nxt.clamp_min(0)] - steps.step, torch.ones_like(steps.step))
    delta = effective_step_rewards(rewards, group_ids, steps) + gamma ** gap.double() * following - v
    return discounted(delta, group_ids, steps, gamma * lam)


def step_returns(rewards: torch.Tensor, group_ids: torch.Tensor, steps: StepBatch, gamma: float) -> torch.Tensor:
    """[N] float64: R_t = Σ_{u>=t} γ^{u-t} r_u, the discounted return from each step."""
    return discounted(effective_step_rewards(rewards, group_ids, steps), group_ids, steps, gamma)


def state_groups(group_ids: torch.Tensor, steps: StepBatch) -> torch.Tensor:
    """[N] long: steps of one group that acted in the same state share an id (GiGPO's anchor-state
    groups; a sample outside an episode has a state of its own)."""
    gid, ep, key = group_ids.tolist(), steps.episode.tolist(), steps.state_key.tolist()
    return dense_ids([(gid[i], key[i]) if ep[i] >= 0 else ("single", i) for i in range(len(gid))])


def moments_within(
    values: torch.Tensor, ids: torch.Tensor, ok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one place the step-level estimators take a set's statistics: for each sample, over the
    valid (`ok`) samples sharing its id (any integers: rollout group, anchor state, context),
    (count, mean, population variance), each [N] float64. Invalid values (NaN included) never count."""
    _, inverse = torch.unique(ids, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    count, mean, var = group_moments(values, inverse, k, ok)
    return count[inverse], mean[inverse], var[inverse]


def normalized_within(
    values: torch.Tensor,
    ids: torch.Tensor,
    ok: torch.Tensor,
    normalize_std: bool,
    eps: float,
    bessel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values minus the mean of their id's valid values, divided by that set's std + eps if asked
    — Bessel's, as `grpo`, or the population std with `bessel=False` (GAGPO) — [N] float64; whether
    the set has >= 2 valid values [N] bool)."""
    count, mean, var = moments_within(values, ids, ok)
    if bessel:
        var = var * count / (count - 1).clamp_min(1)
    adv = values.double() - mean
    if normalize_std:
        adv = adv / (var.sqrt() + eps)
    return adv, (count > 1) & ok


def episode_advantage(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    steps: StepBatch,
    valid: torch.Tensor | None,
    normalize_std: bool,
    eps: float,
) -> torch.Tensor:
    """[N] float64: GRPO over the group's *episodes*, each counted once (its reward: its last step's),
    broadcast to its steps. GRPO over the step samples would count an episode once per step, so its
    baseline would lean towards the long episodes (docs/algorithms.md, "Per-turn baselines")."""
    ok = valid_mask(rewards, group_ids, valid)
    eps_ix = episodes(group_ids, steps)
    last = torch.tensor([ix[-1] for ix in eps_ix], dtype=torch.long)
    ep_ok = torch.tensor([bool(ok[ix].any()) for ix in eps_ix], dtype=torch.bool)
    per_episode = grpo(rewards[last], group_ids[last], normalize_std=normalize_std, valid=ep_ok, eps=eps).double()
    out = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for e, ix in enumerate(eps_ix):
        out[ix] = per_episode[e]
    return torch.where(ok, out, torch.zeros((), dtype=torch.float64))


def check_discount(gamma: float, option: str = "gamma") -> None:
    need(0.0 < gamma <= 1.0, option, f"must be in (0, 1], got {gamma}")
