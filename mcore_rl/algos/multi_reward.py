"""Advantages across domains and reward heads: the inputs they share, and how they reach the learner.

A multi-domain batch carries, besides the scalar reward of each sample, its *domain id* [N] (an
index into the sorted domain names of the batch) and its *reward-head matrix* [N, H] (one column
per named reward of the batch's domains, `head_names` in sorted order, NaN where a sample's domain
has no such head). Two kinds of registered functions use them:

* kind **"advantage"** — the signature of every estimator is extended, not forked:
  `fn(rewards [N], group_ids [N], *, normalize_std, valid, domain_ids=None, reward_heads=None,
  head_names=(), **options) -> [N] float32`. TMN-Reweight (`golongrl`) needs the domains, DVAO
  (`dvao`) and PAPO (`papo`) need the heads, and each *replaces* the group normalisation, so they
  are estimators; GRPO, Dr.GRPO and RLOO accept the new inputs and ignore them. One signature keeps
  the learner free of branches on names, and `None` inputs mean "one domain, no heads", so every
  estimator still runs on a plain (rewards, group ids) batch. The step-level estimators (GiGPO,
  HGPO, GAGPO) also name `steps`, the batch's episode structure (`step_credit.py`), an optional
  input the learner passes only to the functions that name it.
* kind **"reward_shaping"** (new) — `fn(rewards [N], group_ids [N], *, valid, domain_ids,
  reward_heads, head_names, lengths, **options) -> [N] float32`, the new scalar reward. ALP's
  length penalty (`alp`) and CGPO's mixture of judges (`cgpo_judges`) change the *reward* and
  compose with any estimator (ALP "works with any group-based estimator"; CGPO zeroes a violating
  sample "before advantage computation"). As estimators they would need one name per
  (shaping, estimator) pair, so they are a list applied in order before the advantage
  (`algorithm.reward_shaping`), each restricted to some domains if asked (`restrict_to_domains`).

After the advantage, CGPO's per-task weights ρ_l (`algorithm.domain_advantage_weights`) scale each
domain's advantages (`cgpo.weight_domains`); the policy losses are positively homogeneous in the
advantage, so the update is Σ_l ρ_l ḡ_l.

Options come from the config (`algorithm.advantage_options`, `algorithm.reward_shaping[i].options`)
as keyword arguments; a function rejects a bad value with `OptionError(option, message)`, which
validation reports under the option's dotted key before any worker starts.

Statistics: the learner holds the whole batch on every rank, so group and domain statistics are
taken over the full batch and are the same on every data-parallel rank (no reduction needed).
Invalid samples (`valid` False) count in no statistic and get advantage 0; a group with fewer than
2 valid samples gets advantage 0, as in `advantages.py`. Each paper's own std is used: population
std for DVAO and PAPO, Bessel's for TMN (its per-prompt σ_u), as their specs write them.
"""

from __future__ import annotations

import inspect
from typing import Any
from collections.abc import Mapping, Sequence

import torch

# Inputs every function of a kind receives from the learner; anything else in its signature is an option.
ADVANTAGE_INPUTS = ("rewards", "group_ids", "normalize_std", "valid", "domain_ids", "reward_heads", "head_names")
# reward_shaping and sample_filter: `lengths` [N] response tokens, `seq_logp` [N] π_old's summed response log-prob
SHAPING_INPUTS = ("rewards", "group_ids", "valid", "domain_ids", "reward_heads", "head_names", "lengths", "seq_logp")
FILTER_INPUTS = SHAPING_INPUTS
# advantage_shaping: per-token [N, T] advantages, mask, π_old's entropy and log-probs, μ, π_ref's (or None)
ADVANTAGE_SHAPING_INPUTS = (
    "advantages",
    "mask",
    "rewards",
    "group_ids",
    "valid",
    "domain_ids",
    "reward_heads",
    "head_names",
    "entropy",
    "old_logp",
    "rollout_logp",
    "ref_logp",
)
# aux_loss: π_θ's log-probs [n, T] (with grad) and the micro-batch's per-sequence tensors: the shaped rewards
# and the sequence-level advantage before advantage shaping ([n]; a micro-batch may hold part of a group, so
# group statistics belong in the advantage phase), π_ref's log-probs (None without a reference model)
AUX_LOSS_INPUTS = (
    "logp",
    "old_logp",
    "ref_logp",
    "mask",
    "rewards",
    "seq_advantages",
    "group_ids",
    "agg",
    "norm_length",
)
# policy_loss: the loss's positional inputs (`train/rl_step.py: loss_fn`); its options are keyword-only
POLICY_LOSS_INPUTS = (
    "logp",
    "old_logp",
    "advantages",
    "mask",
    "clip_low",
    "clip_high",
    "dual_clip",
    "is_weights",
    "agg",
    "norm_length",
)
KIND_INPUTS = {
    "advantage": ADVANTAGE_INPUTS,
    "policy_loss": POLICY_LOSS_INPUTS,
    "reward_shaping": SHAPING_INPUTS,
    "sample_filter": FILTER_INPUTS,
    "advantage_shaping": ADVANTAGE_SHAPING_INPUTS,
    "aux_loss": AUX_LOSS_INPUTS,
}
# Inputs a function of the kind receives only when its signature names them, so adding one breaks no
# registered function. advantage_shaping: `response_ids` [N, T] long, the sampled token ids (0 off the
# mask); `logp_at`, a function ids [k] -> [N, T, k] π_old's log-probs of those ids at every response
# position (one more forward of the policy, called on every rank alike). DelTA's gradient proxy needs both.
# advantage: `steps`, a `step_credit.StepBatch` (each sample's episode, step, state key and step reward),
# given to the step-level estimators (GiGPO, HGPO, GAGPO); `branches` [N] bool, which samples are branches of a
# tree rollout (`SampleMarks.branch_of`), given to APPO's dual-group advantage.
OPTIONAL_INPUTS = {"advantage_shaping": ("response_ids", "logp_at"), "advantage": ("steps", "branches", "values")}


def takes_input(fn: Any, name: str) -> bool:
    """Does `fn`'s signature name the optional input `name`?"""
    return name in inspect.signature(fn).parameters


def declared_inputs(fn: Any, kind: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """`inputs` without the optional inputs of `kind` that `fn`'s signature does not name."""
    params = inspect.signature(fn).parameters
    optional = OPTIONAL_INPUTS.get(kind, ())
    return {k: v for k, v in inputs.items() if k not in optional or k in params}


class OptionError(ValueError):
    """A bad option value; `option` is its name, so validation can name the dotted config key."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option, self.message = option, message


def need(cond: bool, option: str, message: str) -> None:
    if not cond:
        raise OptionError(option, message)


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(each sample's group index [N] in 0..K-1, K)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, (int(inverse.max()) + 1 if inverse.numel() else 0)


def group_moments(
    values: torch.Tensor, inverse: torch.Tensor, k: int, ok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group [K] over its `ok` samples: (count, mean, population variance), float64.
    Values of samples that are not ok (NaN included) do not matter."""
    okd = ok.double()
    v = torch.where(ok, values.double(), torch.zeros((), dtype=torch.float64))
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, okd)
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, v) / count.clamp_min(1)
    dev = (v - mean[inverse]) * okd
    var = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, dev * dev) / count.clamp_min(1)
    return count, mean, var


def domains_of(domain_ids: torch.Tensor | None, n: int) -> torch.Tensor:
    """Domain ids [N] long (all 0 when None: one domain)."""
    if domain_ids is None:
        return torch.zeros(n, dtype=torch.long)
    if domain_ids.shape != (n,):
        raise ValueError(f"domain_ids {tuple(domain_ids.shape)} must be [{n}]")
    return domain_ids.long()


def group_domains(domain_ids: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """The domain of each group [K]; a group is one prompt, so all its samples share a domain."""
    lo = torch.full((k,), torch.iinfo(torch.long).max, dtype=torch.long).scatter_reduce_(0, inverse, domain_ids, "amin")
    hi = torch.full((k,), torch.iinfo(torch.long).min, dtype=torch.long).scatter_reduce_(0, inverse, domain_ids, "amax")
    if not torch.equal(lo, hi):
        raise ValueError(f"a group (one prompt's samples) spans several domains: {int((lo != hi).sum())} of {k} groups")
    return lo


def head_column(reward_heads: torch.Tensor | None, head_names: Sequence[str], name: str, n: int) -> torch.Tensor:
    """Head `name` as [N] float64; NaN where a sample (or the whole batch) lacks it. A head absent
    from the batch is not an error: a batch may hold no sample of the domains that have it."""
    if reward_heads is None or name not in head_names:
        return torch.full((n,), float("nan"), dtype=torch.float64)
    if reward_heads.shape != (n, len(head_names)):
        raise ValueError(f"reward_heads {tuple(reward_heads.shape)} must be [{n}, {len(head_names)}] (head_names)")
    return reward_heads[:, list(head_names).index(name)].double()


def restrict_to_domains(
    new: torch.Tensor, old: torch.Tensor, domain_ids: torch.Tensor, domain_names: Sequence[str], domains: Sequence[str]
) -> torch.Tensor:
    """`new` on the samples of `domains` (all when empty), `old` elsewhere. A domain that is not in
    this batch selects nothing."""
    if not domains:
        return new
    ids = [i for i, d in enumerate(domain_names) if d in set(domains)]
    inside = torch.isin(domain_ids, torch.tensor(ids, dtype=torch.long))
    inside = inside.reshape(-1, *([1] * (new.ndim - 1)))  # per-sample or per-token values
    return torch.where(inside, new.to(old.dtype), old)


def domain_metrics(
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    domain_ids: torch.Tensor,
    domain_names: Sequence[str],
) -> dict[str, float]:
    """`advantage/<domain>/...` over the valid samples of each domain in the batch: the mean reward
    the advantage saw, the mean and mean |A|, the share of zero advantages, the sample count."""
    out: dict[str, float] = {}
    for i, name in enumerate(domain_names):
        sel = (domain_ids == i) & valid
        k = int(sel.sum())
        key = f"advantage/{name or '<none>'}"
        out[f"{key}/samples"] = float(k)
        if k == 0:
            continue
        a, r = advantages[sel].double(), rewards[sel].double()
        out[f"{key}/reward_mean"] = float(r.mean())
        out[f"{key}/mean"] = float(a.mean())
        out[f"{key}/abs_mean"] = float(a.abs().mean())
        out[f"{key}/zero_frac"] = float((a == 0).double().mean())
    return out


def _same_type(default: Any, value: Any) -> bool:
    """Does `value` fit an option whose default is `default`? (None and other defaults: anything;
    an int where a float is expected is fine, a bool is never a number.)"""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        kinds = (int, float) if isinstance(default, float) else (int,)
        return isinstance(value, kinds) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    return True


def sample_inputs(kind: str) -> tuple[tuple, dict[str, Any]]:
    """A two-sample batch (positional and keyword inputs) of `kind`, to try a function's options on."""
    rewards, gids = torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long)
    common: dict[str, Any] = dict(
        valid=torch.ones(2, dtype=torch.bool),
        domain_ids=torch.zeros(2, dtype=torch.long),
        reward_heads=torch.zeros(2, 0),
        head_names=(),
    )
    tokens = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]])
    if kind == "advantage":
        from mcore_rl.algos.step_credit import StepBatch  # lazy: import cycle (step_credit uses this module)

        # two one-step episodes from the group's state
        steps = StepBatch(
            torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), rewards
        )
        from mcore_rl.algos.critic import ValueBatch  # lazy: as above

        values = ValueBatch(torch.tensor([[0.5, 0.25], [0.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
        return (rewards, gids), dict(
            common, normalize_std=True, steps=steps, branches=torch.zeros(2, dtype=torch.bool), values=values
        )
    if kind in ("reward_shaping", "sample_filter"):
        return (rewards, gids), dict(common, lengths=torch.full((2,), 2, dtype=torch.long), seq_logp=tokens.sum(1))
    if kind == "advantage_shaping":
        logits = torch.arange(24.0).reshape(2, 2, 6).sin()  # a vocabulary of 6 at the 2 x 2 response positions
        return (torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), torch.ones(2, 2)), dict(
            common,
            rewards=rewards,
            group_ids=gids,
            entropy=torch.full((2, 2), 0.5),
            old_logp=tokens,
            rollout_logp=tokens,
            ref_logp=tokens - 0.1,
            response_ids=torch.tensor([[3, 4], [3, 5]]),
            logp_at=lambda ids: torch.log_softmax(logits, -1)[..., ids.long()],
        )
    if kind == "aux_loss":
        return (tokens.clone().requires_grad_(),), dict(
            old_logp=tokens,
            ref_logp=tokens - 0.1,
            mask=torch.ones(2, 2),
            rewards=rewards,
            seq_advantages=rewards - 0.5,
            group_ids=gids,
            agg="token-mean",
            norm_length=2,
        )
    if kind == "policy_loss":
        return (tokens.clone().requires_grad_(), tokens, rewards - 0.5, torch.ones(2, 2)), {}
    raise KeyError(f"no sample inputs for algorithm kind {kind!r}")


def option_problems(kind: str, name: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What is wrong with `options` for the registered `kind` function `name`, as (option, message)
    pairs (option "" when the call fails as a whole): unknown names, values of the wrong type for
    the option's default, and values the function itself rejects when called with the kind's
    inputs on a two-sample batch (which also catches a registration without the kind's signature)."""
    from mcore_rl.algos.registry import get, literal_problems  # lazy: import cycle

    fn = get(kind, name)
    outside = dict(literal_problems(fn, dict(options)))
    inputs = KIND_INPUTS[kind] + OPTIONAL_INPUTS.get(kind, ())
    params = {
        p.name: p
        for p in inspect.signature(fn).parameters.values()
        if p.name not in inputs and p.kind == inspect.Parameter.KEYWORD_ONLY
    }
    problems: list[tuple[str, str]] = []
    for key, value in options.items():
        if key not in params:
            problems.append((key, f"is not an option of {kind} {name!r}; its options: {', '.join(params) or 'none'}"))
            continue
        default = params[key].default
        if key in outside:
            problems.append((key, outside[key]))
        elif not _same_type(default, value):
            problems.append((key, f"expects {type(default).__name__} (default {default!r}), got {value!r}"))
    if problems:
        return problems
    args, batch = sample_inputs(kind)
    batch = declared_inputs(fn, kind, batch)
    try:
        fn(*args, **batch, **options)
    except OptionError as e:
        problems.append((e.option, e.message))
    except (TypeError, ValueError) as e:
        problems.append(
            ("", f"{kind} {name!r} cannot be called with its kind's inputs and these options: {type(e).__name__}: {e}")
        )
    return problems
