"""The learner's use of the "distill" kind: teacher scores -> `DistillBatch` -> terms in the update.

`distill.losses` names registered functions (`mcore_rl.algos.distill`); each carries its phase.
Nothing here branches on a function's name:

* advantage phase, once per rollout batch in `Learner.prepare`, with `student_logp = old_logp`:
  `coef · token_advantage` is added to the RL advantages ([N] -> [N, T]; zero RL advantages with
  `distill.rl: false`), `token_mask` multiplies the loss mask on the distilled tokens;
* loss phase, per micro-batch in `Learner.loss_fn`, with the differentiable log-probs (and the
  student's log-probs at the teacher's top-k ids, from the vocab-parallel logits): `coef · loss_sum`
  is added to the policy loss, which shares its aggregation and count. Once per batch, before the
  update, `start_batch` moves the loss-phase terms' states (Direct-OPD's adaptive KL weight) and
  logs the stateless ones' metrics at π_old.

The teacher's view of a batch (`TeacherView`) is built from `Sample.teacher`: a sample without
teacher scores, or whose teacher failed (`teacher.error`), or without the top-k the config asks
for, gets distillation mask 0 (with `distill.rl: true` it still gets its RL loss). The horizon
(`distill.horizon`, POPD/TOPD) masks every distillation term beyond H, and the rollout manager
asks the engines for at most H tokens (`generation_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import torch

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos import registry
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, make_state, term_coef
from mcore_rl.algos.distill.popd import horizon_mask, horizon_tokens
from mcore_rl.data.samples import DISTILL_SPAN, Prompt, Sample

# per-sample tensors the loss phase needs in each micro-batch (sliced by `build_microbatches`)
DISTILL_KEYS = (
    "teacher_logp",
    "distill_mask",
    "teacher_topk_ids",
    "teacher_topk_logp",
    "teacher_ref_logp",
    "teacher_ref_topk_logp",
    "response_mask",
    "distill_rewards",
    "distill_group_ids",
    "distill_group_mean_reward",
    "student_entropy",
)


@dataclass
class DistillTerm:
    name: str
    fn: Callable[..., DistillTerms]
    coef: float
    options: dict[str, Any]
    state: Any = None  # a `@stateful` function's state across batches (passed as `state=`)

    @property
    def phase(self) -> str:
        return self.fn.phase  # type: ignore[attr-defined]  # a flag on the function object

    def __call__(self, batch: DistillBatch) -> DistillTerms:
        return self.fn(batch, **self.options, **({} if self.state is None else {"state": self.state}))


def distill_terms(cfg: RLConfig) -> list[DistillTerm]:
    """The configured terms, looked up in the registry (validation has checked names and options);
    a `@stateful` function gets its state object here, once per run."""
    d = cfg.distill
    out = []
    for x in d.losses:
        fn = registry.get("distill", x.name)
        out.append(DistillTerm(x.name, fn, term_coef(fn, x.coef), dict(x.options), make_state(fn, x.options)))
    return out


def terms_state_dict(terms: Sequence[DistillTerm]) -> dict[str, Any]:
    """The states of the stateful terms, by name (saved with the checkpoints)."""
    return {t.name: t.state.state_dict() for t in terms if t.state is not None}


def load_terms_state(terms: Sequence[DistillTerm], state: dict[str, Any]) -> None:
    for t in terms:
        if t.state is not None and t.name in state:
            t.state.load_state_dict(state[t.name])


def horizon_at(cfg: RLConfig, step: int, domain: str | None = None) -> int | None:
    """H at rollout step `step` for a prompt of `domain` (None: every prompt; no cut: None)."""
    d = cfg.distill
    if not d.losses:
        return None
    h = d.horizon
    if domain is not None and h.domains and domain not in h.domains:
        return None
    return horizon_tokens(
        h.schedule,
        step,
        cfg.rollout.max_new_tokens,
        rho=h.rho,
        tokens=h.tokens,
        h0=h.h0,
        delta_h=h.delta_h,
        delta_k=h.delta_k,
    )


def generation_budget(cfg: RLConfig, prompt: Prompt, step: int) -> int:
    """New tokens a training rollout of `prompt` may generate: the prompt's budget, at most
    `rollout.max_new_tokens`, cut at the distillation horizon."""
    cap = min(prompt.max_new_tokens or cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens)
    h = horizon_at(cfg, step, prompt.domain)
    return cap if h is None else min(cap, h)


@dataclass
class TeacherView:
    """[N, T] (and [N, T, k]) teacher tensors of a batch on the sequence view."""

    logp: torch.Tensor
    mask: torch.Tensor  # 1 on response tokens the teacher scored (and inside the horizon)
    topk_ids: torch.Tensor | None = None  # long
    topk_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    ref_topk_logp: torch.Tensor | None = None
    scored_frac: float = 0.0


def teacher_view(
    samples: Sequence[Sample],
    num_positions: int,
    top_k: int,
    horizons: Sequence[int | None],
    vocab_size: int | None = None,
) -> TeacherView:
    """Teacher log-probs of every sample's response tokens, the first `top_k` of its top-k lists,
    and the reference teacher's when every scored sample has them. Top-k ids outside the student's
    vocabulary (`vocab_size`) are an error: their log-probs would silently be wrong."""
    n, t = len(samples), num_positions
    logp = torch.zeros(n, t)
    mask = torch.zeros(n, t)
    ids = torch.zeros(n, t, top_k, dtype=torch.long) if top_k else None
    topk = torch.zeros(n, t, top_k) if top_k else None
    scored = [s.teacher is not None and s.teacher.error is None and len(s.teacher.logp) > 0 for s in samples]
    scored_teachers = [
        s.teacher for s in samples if s.teacher is not None and s.teacher.error is None and s.teacher.logp
    ]
    with_ref = any(scored) and all(ts.ref_logp is not None for ts in scored_teachers)
    with_ref_topk = bool(top_k) and any(scored) and all(ts.ref_topk_logp is not None for ts in scored_teachers)
    ref = torch.zeros(n, t) if with_ref else None
    ref_topk = torch.zeros(n, t, top_k) if with_ref_topk else None
    for i, s in enumerate(samples):
        if not scored[i]:
            continue
        ts, k = s.teacher, len(s.response_ids)
        assert ts is not None  # scored
        if len(ts.logp) != k:
            raise ValueError(
                f"teacher {ts.source!r} scored {len(ts.logp)} tokens of a {k}-token response "
                f"(prompt {s.prompt.index}); Sample.teacher.logp needs one log-prob per response token"
            )
        if top_k:
            if (
                ts.topk_ids is None
                or ts.topk_logp is None
                or len(ts.topk_ids) != k
                or any(len(row) < top_k for row in ts.topk_ids)
            ):
                scored[i] = False  # no usable top-k: this sample is not distilled
                continue
            assert ids is not None and topk is not None  # made with top_k
            ids[i, :k] = torch.tensor([row[:top_k] for row in ts.topk_ids], dtype=torch.long)
            if vocab_size is not None and (int(ids[i].max()) >= vocab_size or int(ids[i].min()) < 0):
                raise ValueError(
                    f"teacher {ts.source!r} returned top-k ids outside the student's vocabulary of "
                    f"{vocab_size} (prompt {s.prompt.index}): teachers must share the student's tokenizer"
                )
            topk[i, :k] = torch.tensor([row[:top_k] for row in ts.topk_logp], dtype=torch.float32)
            if ref_topk is not None and ts.ref_topk_logp is not None:  # (with_ref_topk: every scored one has them)
                ref_topk[i, :k] = torch.tensor([row[:top_k] for row in ts.ref_topk_logp], dtype=torch.float32)
        logp[i, :k] = torch.tensor(ts.logp, dtype=torch.float32)
        if ref is not None and ts.ref_logp is not None:  # (with_ref: every scored one has them)
            ref[i, :k] = torch.tensor(ts.ref_logp, dtype=torch.float32)
        mask[i, :k] = horizon_mask(t, horizons[i])[:k]
        span = s.info.get(DISTILL_SPAN)
        if span is not None:  # only a step's tagged action span is distilled (`agent/spans.py`)
            if len(span) != k:
                raise ValueError(
                    f"{DISTILL_SPAN} of prompt {s.prompt.index} has {len(span)} entries for a {k}-token response"
                )
            mask[i, :k] *= torch.tensor(span, dtype=torch.float32)
    return TeacherView(logp, mask, ids, topk, ref, ref_topk, scored_frac=sum(scored) / max(n, 1))


def packed_topk_ids(mb: dict[str, torch.Tensor], ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[b, s, k] ids on a micro-batch's packed grid from the per-sample [n, T, k] ids: position
    `seq_pos[i, j]` (whose label is response token j of sample i) gets that token's teacher top-k."""
    b, s = mb["labels"].shape
    out = torch.zeros(b * s, ids.shape[-1], dtype=torch.long)
    where = response_mask > 0
    out[mb["seq_pos"][where]] = ids[where]
    return out.view(b, s, -1)


def add_packed_topk(mbs: list[dict[str, torch.Tensor]]) -> None:
    """Give every micro-batch holding `teacher_topk_ids` its `label_topk_ids` for the forward."""
    for mb in mbs:
        if "teacher_topk_ids" in mb:
            mb["label_topk_ids"] = packed_topk_ids(mb, mb["teacher_topk_ids"], mb["response_mask"])


def call_terms(
    terms: Sequence[DistillTerm], batch: DistillBatch, metrics: dict[str, float]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run `terms` on `batch`: (Σ coef·token_advantage, Π token_mask, Σ coef·loss_sum), None where
    no term gave one; each term's metrics land in `metrics` as distill/<name>/<key>."""
    adv = mask = loss = None
    for term in terms:
        out = term(batch)
        if out.token_advantage is not None:
            a = term.coef * out.token_advantage.detach()
            adv = a if adv is None else adv + a
        if out.token_mask is not None:
            mask = out.token_mask.detach() if mask is None else mask * out.token_mask.detach()
        if out.loss_sum is not None:
            loss = term.coef * out.loss_sum if loss is None else loss + term.coef * out.loss_sum
        for k, v in out.metrics.items():
            metrics[f"distill/{term.name}/{k.removeprefix(term.name + '/')}"] = float(v)
    return adv, mask, loss


def start_batch(loss_terms: Sequence[DistillTerm], batch: DistillBatch, metrics: dict[str, float]) -> None:
    """Once per rollout batch, at π_old (`batch.student_logp = old_logp`), before the update: every
    stateful loss-phase term's state takes its step (`state.start_batch(batch)`, e.g. Direct-OPD's
    α for this batch) and the stateless ones report their metrics at π_old (their loss: per
    optimizer step). Metrics land in `metrics` as distill/<name>/<key>."""
    stateless = []
    for term in loss_terms:
        if term.state is None:
            stateless.append(term)
        elif hasattr(term.state, "start_batch"):
            for k, v in term.state.start_batch(batch).items():
                metrics[f"distill/{term.name}/{k}"] = float(v)
    call_terms(stateless, batch, metrics)


def per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """RL advantages [N] or [N, T] as [N, T]."""
    return advantages[:, None].expand_as(like).clone() if advantages.ndim == 1 else advantages.clone()


def batch_topk(stats_topk: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor | None:
    """The student's [n, T, k] top-k log-probs gathered from a micro-batch's [b, s, k] stats."""
    if stats_topk is None:
        return None
    return stats_topk.reshape(-1, stats_topk.shape[-1])[pos]
