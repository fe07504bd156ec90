"""The RL step of the learner: one rollout batch -> π_old (and π_ref) -> reward shaping -> advantages
-> mismatch correction -> several optimizer steps over mini-batches.

Collective over the trainer world: every rank holds the same samples (rank 0 broadcasts them),
builds the same sequence view, runs its data-parallel share of every micro-batch, and gets the same
metrics. The corrections are computed once on the whole batch before it is split (they may
normalise over it), then travel with each sample into its micro-batch. The loss is the registered
policy loss on [n, T] views gathered from the packed micro-batch, plus KL and entropy terms with
the same aggregation (megatron-core divides the summed loss by one count summed over micro-batches
and DP ranks, so every term must share it).

Every algorithm is looked up in `mcore_rl.algos.registry` by its config name and called with its
kind's one signature, so nothing here branches on an algorithm's name. Distillation terms
(`distill.losses`, see `train.distillation`) enter the same way: advantage-phase terms once per
batch in `prepare`, loss-phase terms per micro-batch in `loss_fn`. Recipes (`mcore_rl/hooks.py`)
may change the μ the mismatch correction sees (`behaviour_logp`, e.g. for samples another model
wrote) and add metrics (`learner_metrics`); the mismatch metrics are the policy's own samples'.
An estimator that reads a critic (`gae`, `steppo`: its signature names `values`) gets the critic's
values (`train/critic.py`), and the critic takes one optimizer step on each mini-batch the policy
does, towards the returns the estimator's `@reads_critic` targets give (`algos/critic.py`).
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.agent.episodes import step_batch
from mcore_rl.algos import registry
from mcore_rl.algos.advantages import too_few_valid_frac
from mcore_rl.algos.cgpo import weight_domains
from mcore_rl.algos.critic import ValueBatch, critic_targets, explained_variance, takes_values
from mcore_rl.algos.distill.base import DistillBatch, group_mean
from mcore_rl.algos.kl import kl_estimate, kl_loss, kl_penalized_rewards
from mcore_rl.algos.mismatch import mismatch_metrics
from mcore_rl.algos.multi_reward import declared_inputs, domain_metrics, restrict_to_domains, takes_input
from mcore_rl.algos.policy_loss import masked_mean
from mcore_rl.algos.step_credit import takes_steps
from mcore_rl.data.samples import Sample
from mcore_rl.hooks import Recipe, active
from mcore_rl.progress import progress
from mcore_rl.train.distillation import (
    DistillTerm,
    add_packed_topk,
    batch_topk,
    call_terms,
    distill_terms,
    horizon_at,
    load_terms_state,
    per_token,
    start_batch,
    teacher_view,
    terms_state_dict,
)
from mcore_rl.train import routing_replay
from mcore_rl.train.forward_backward import forward_backward
from mcore_rl.train.logprobs import compute_token_stats, make_forward_step
from mcore_rl.train.mtp_loss import MTPForwardStep
from mcore_rl.config.model_keys.mtp import MTPKeys
from mcore_rl.train.packing import SequenceView, build_microbatches, sequence_view, split_minibatches

# Loss-side metrics, summed over tokens (or sequences) in each micro-batch and reduced over ranks.
LOSS_METRICS = ("pg/clipfrac", "pg/dual_clipfrac", "pg/ratio_mean", "pg/approx_kl", "kl/loss", "entropy/loss")
# what the model's forward reads from a micro-batch
MODEL_KEYS = (
    "tokens",
    "labels",
    "loss_mask",
    "stats_mask",  # log-probs and entropy only at the trained tokens (train/logprobs.py)
    "position_ids",
    "segment_ids",
    "label_topk_ids",
    "routed_experts",
    "label_mask_ids",
    "label_mask_counts",
)  # the last two: sampling-mask replay


def _dp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def _comm_device() -> torch.device:
    """Where collective buffers must live: the current GPU under NCCL, else the CPU (gloo)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_last_stage(vec: torch.Tensor) -> torch.Tensor:
    """Sum a per-rank metric vector over DP and hand the last pipeline stage's value to all stages."""
    from megatron.core import parallel_state as ps

    dp, pp = ps.get_data_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if dp == 1 and pp == 1:
        return vec
    buf = vec.to(_comm_device())
    if dp > 1:
        dist.all_reduce(buf, group=ps.get_data_parallel_group())
    if pp > 1:
        dist.broadcast(
            buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    return buf.cpu()


def mismatch_overrides(cfg: RLConfig) -> dict[str, Any]:
    """`algorithm.mismatch`'s set fields as `MismatchConfig` overrides of the named correction."""
    m = cfg.algorithm.mismatch
    return {
        k: v
        for k, v in dict(
            is_level=m.level,
            is_clip_low=m.clip_low,
            is_clip_high=m.clip_high,
            mask_low=m.mask_low,
            mask_high=m.mask_high,
            veto_threshold=m.veto_threshold,
            batch_normalize=m.batch_normalize,
        ).items()
        if v is not None
    }


def branch_flags(samples: Sequence[Sample]) -> torch.Tensor:
    """[N] bool: which samples are branches of a tree rollout (`SampleMarks.branch_of`)."""
    return torch.tensor([s.marks.branch_of is not None for s in samples], dtype=torch.bool)


def batch_inputs(view: SequenceView, valid: torch.Tensor) -> dict[str, Any]:
    """What every advantage and reward-shaping function gets besides rewards and group ids."""
    return dict(valid=valid, domain_ids=view.domain_ids, reward_heads=view.reward_heads, head_names=view.head_names)


def shaped_rewards(a: Any, view: SequenceView, valid: torch.Tensor, old: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's rewards after `algorithm.reward_shaping`, in order, each on its domains only
    (`old`: π_old's [N, T] log-probs, for `seq_logp`)."""
    rewards = view.rewards
    for shaping in a.reward_shaping:
        new = registry.get("reward_shaping", shaping.name)(
            rewards, view.group_ids, **sequence_inputs(view, old), **batch_inputs(view, valid), **shaping.options
        )
        rewards = restrict_to_domains(new, rewards, view.domain_ids, view.domain_names, shaping.domains)
    return rewards


def sequence_inputs(view: SequenceView, old: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """Per-sequence inputs of reward shaping and sample filters: response lengths and π_old's
    summed log-prob of each response."""
    return dict(lengths=view.mask.sum(1).long(), seq_logp=None if old is None else (old * view.mask).sum(1))


def filtered(
    a: Any, view: SequenceView, valid: torch.Tensor, old: torch.Tensor, metrics: dict[str, float]
) -> torch.Tensor:
    """`valid` narrowed by `algorithm.sample_filters`, in order (each on its domains only): a
    filtered-out sample trains on nothing and leaves its group's statistics, like an unusable one."""
    for f in a.sample_filters:
        keep = registry.get("sample_filter", f.name)(
            view.rewards, view.group_ids, **sequence_inputs(view, old), **batch_inputs(view, valid), **f.options
        )
        keep = restrict_to_domains(keep.bool() & valid, valid, view.domain_ids, view.domain_names, f.domains)
        metrics[f"filter/{f.name}/dropped_frac"] = float((valid & ~keep).double().sum() / max(int(valid.sum()), 1))
        valid = keep
    return valid


def shaped_advantages(
    a: Any,
    view: SequenceView,
    valid: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    old: torch.Tensor,
    entropy: torch.Tensor,
    ref: torch.Tensor | None,
    optional_inputs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The advantages after `algorithm.advantage_shaping`, in order: [N] when there is none, else
    per token [N, T] (each step on its domains only). `optional_inputs` (`response_ids`, `logp_at`;
    see `multi_reward.OPTIONAL_INPUTS`) go to the functions that name them."""
    if not a.advantage_shaping:
        return advantages
    tokens = (advantages[:, None] if advantages.ndim == 1 else advantages).float() * mask
    for shaping in a.advantage_shaping:
        fn = registry.get("advantage_shaping", shaping.name)
        optional = declared_inputs(fn, "advantage_shaping", optional_inputs or {})
        new = fn(
            tokens,
            mask,
            rewards=rewards,
            group_ids=view.group_ids,
            entropy=entropy,
            old_logp=old,
            rollout_logp=view.rollout_logp,
            ref_logp=ref,
            **batch_inputs(view, valid),
            **optional,
            **shaping.options,
        )
        tokens = restrict_to_domains(new.float() * mask, tokens, view.domain_ids, view.domain_names, shaping.domains)
    return tokens


def response_ids(samples: Sequence[Sample], num_positions: int) -> torch.Tensor:
    """[N, T] long: each sample's response token ids, right-padded with 0."""
    out = torch.zeros(len(samples), num_positions, dtype=torch.long)
    for i, s in enumerate(samples):
        out[i, : len(s.response_ids)] = torch.tensor(s.response_ids, dtype=torch.long)
    return out


def domain_mismatch_metrics(
    samples: Sequence[Sample], old: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`mismatch_metrics` over each domain's samples: `mismatch/<domain>/k3`, `.../abs_logp_diff`."""
    out = {}
    domains = [s.prompt.domain for s in samples]
    for d in sorted(set(domains)):
        rows = torch.tensor([x == d for x in domains], dtype=mask.dtype)[:, None]
        for key, v in mismatch_metrics(old, rollout_logp, mask * rows).items():
            out[key.replace("mismatch/", f"mismatch/{d}/", 1)] = v
    return out


class Learner:
    """Policy-update side of the loop, around megatron-core model chunks and their optimizer."""

    def __init__(
        self,
        cfg: RLConfig,
        chunks: list,
        optimizer: Any,
        ref_chunks: list | None,
        pad_id: int,
        recipes: Sequence[Recipe] | None = None,
        critic: Any = None,
    ) -> None:
        self.cfg, self.chunks, self.optimizer, self.ref_chunks, self.pad_id = cfg, chunks, optimizer, ref_chunks, pad_id
        self.critic = critic  # train/critic.py's Critic, for an advantage that reads values (gae, steppo)
        self.recipes = list(recipes) if recipes is not None else active(cfg)  # their learner-side hooks
        self.temperature = cfg.rollout.temperature
        self.distill: list[DistillTerm] = distill_terms(cfg)
        self.loss_terms = [x for x in self.distill if x.phase == "loss"]
        # metric sums of one micro-batch: tokens, LOSS_METRICS, each loss-phase term's loss, the loss count
        self.metric_keys = (
            LOSS_METRICS
            + tuple(f"distill/{x.name}/loss" for x in self.loss_terms)
            + tuple(f"aux/{x.name}/loss" for x in cfg.algorithm.aux_losses)
        )
        self.step = 0
        # MoE routing replay (train/routing_replay.py): the policy's routers only, never π_ref's
        self.replay_mode = cfg.algorithm.routing_replay
        self.replay_taps = routing_replay.attach(chunks) if self.replay_mode != "none" else []
        self.routing: list | None = None  # this batch's per-sample routing to replay (r3: engine's, r2: π_old's)
        self.has_mtp_heads = cfg.model.section(MTPKeys).mtp_num_layers > 0  # MTP draft heads (train/mtp_loss.py)

    # ---------------------------------------------------------------- forward-only log-probs

    def token_logprobs(
        self,
        samples: Sequence[Sample],
        num_positions: int,
        chunks: list | None = None,
        with_entropy: bool = False,
        sampling_masks: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, T] log-probs (and entropy) of every sample's response tokens under `chunks`
        (default: the policy), identical on every rank. `sampling_masks` (default
        `rollout.sampling_mask_replay`): renormalise over the samples' supports (a teacher's
        log-probs do not)."""
        logp, entropy, _ = self.token_stats(samples, num_positions, chunks, with_entropy, sampling_masks=sampling_masks)
        return logp, entropy

    def token_stats(
        self,
        samples: Sequence[Sample],
        num_positions: int,
        chunks: list | None = None,
        with_entropy: bool = False,
        topk_ids: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        routing: list | None = None,
        sampling_masks: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`token_logprobs` plus, with `topk_ids` [N, T, k] (and the [N, T] `response_mask`), the
        [N, T, k] log-probs of those ids at every response position, from the vocab-parallel logits.
        `routing` (per sample): experts to replay in the policy's routers (routing replay)."""
        chunks = chunks or self.chunks
        t = self.cfg.train
        dp_rank, dp_size = _dp()
        per_seq = None
        if topk_ids is not None:
            if response_mask is None:
                raise ValueError("token_stats: topk_ids need the response_mask")
            per_seq = {"teacher_topk_ids": topk_ids, "response_mask": response_mask}
        mbs = build_microbatches(
            samples,
            range(len(samples)),
            t.seq_length,
            t.micro_batch_size,
            dp_rank,
            dp_size,
            self.pad_id,
            num_positions,
            per_seq,
            routing=routing,
            sampling_masks=self.cfg.rollout.sampling_mask_replay if sampling_masks is None else sampling_masks,
        )
        add_packed_topk(mbs)
        model_in = [{k: v for k, v in mb.items() if k in MODEL_KEYS} for mb in mbs]
        for c in chunks:
            c.eval()
        stats = compute_token_stats(chunks, model_in, self.temperature, t.logprob_chunk_size, with_entropy)
        n = len(samples)
        rows = 2 if with_entropy else 1
        full = torch.zeros(rows, n, num_positions)
        k = 0 if topk_ids is None else topk_ids.shape[-1]
        full_topk = torch.zeros(n, num_positions, k)
        for mb, st in zip(mbs, stats):
            if mb["seq_index"].numel() == 0:
                continue
            full[0, mb["seq_index"]] = st.logprobs.reshape(-1)[mb["seq_pos"]]
            if with_entropy:
                assert st.entropy is not None  # asked for
                full[1, mb["seq_index"]] = st.entropy.reshape(-1)[mb["seq_pos"]]
            if k:
                topk_at = batch_topk(st.topk_logprobs, mb["seq_pos"])
                assert topk_at is not None  # asked for (topk_ids)
                full_topk[mb["seq_index"]] = topk_at
        if dp_size > 1:  # each sample lives on exactly one DP rank
            from megatron.core import parallel_state as ps

            flat = torch.cat([full.reshape(-1), full_topk.reshape(-1)]).to(_comm_device())
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            flat = flat.cpu()
            full, full_topk = flat[: full.numel()].view_as(full), flat[full.numel() :].view_as(full_topk)
        return full[0], (full[1] if with_entropy else None), (full_topk if k else None)

    # ---------------------------------------------------------------- the update

    def prepare(self, samples: Sequence[Sample], step: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Everything computed once per rollout batch: π_old, π_ref, advantages, corrections, and
        the advantage-phase distillation terms."""
        a = self.cfg.algorithm
        view = sequence_view(samples, a.drop_reward_errors)
        n, t = view.mask.shape
        start = time.perf_counter()
        teacher = None
        if self.distill:
            horizons = [horizon_at(self.cfg, step, s.prompt.domain) for s in samples]
            teacher = teacher_view(samples, t, self.cfg.distill.top_k, horizons, self.cfg.model.vocab_size)
        old_topk = None
        routing = self.replay_routing(samples)
        with routing_replay.recording(self.replay_taps if self.replay_mode == "r2" else []):
            if teacher is not None and teacher.topk_ids is not None:
                old, entropy, old_topk = self.token_stats(
                    samples, t, with_entropy=True, topk_ids=teacher.topk_ids, response_mask=view.mask, routing=routing
                )
            else:
                old, entropy, _ = self.token_stats(samples, t, with_entropy=True, routing=routing)
        assert entropy is not None  # asked for (with_entropy=True)
        if self.replay_mode == "r2":  # replay π_old's own routing in this batch's training forwards
            mc = self.cfg.model
            routing = routing_replay.gather_recorded(
                self.replay_taps,
                samples,
                range(len(samples)),
                self.cfg.train.seq_length,
                self.cfg.train.micro_batch_size,
                mc.num_layers,
                mc.section(MoEKeys).moe_router_topk,
            )
            routing_replay.clear(self.replay_taps)
        self.routing = routing
        ref = None
        if self.ref_chunks is not None:
            ref, _ = self.token_logprobs(samples, t, chunks=self.ref_chunks)
        metrics: dict[str, float] = {"time/logprobs_s": time.perf_counter() - start}
        valid = view.ok.bool()  # unusable samples (aborted, reward errors when dropped) leave the group statistics
        valid = filtered(a, view, valid, old, metrics)
        mask = view.mask * valid[:, None]
        rewards = shaped_rewards(a, view, valid, old)
        if ref is not None:
            kl_tokens = kl_estimate(old, ref, a.kl_estimator) * mask
            metrics["kl/ref"] = float(kl_tokens.sum() / mask.sum().clamp_min(1))
            if a.kl_in_reward:
                rewards = kl_penalized_rewards(rewards, old, ref, mask, a.kl_coef, a.kl_estimator)
        estimator = registry.get("advantage", a.advantage)
        steps = {"steps": step_batch(samples)} if takes_steps(estimator) else {}
        values = self._critic_values(samples, view, estimator, metrics)
        advantages = estimator(
            rewards,
            view.group_ids,
            normalize_std=a.advantage_std_normalize,
            **batch_inputs(view, valid),
            **steps,
            **({"branches": branch_flags(samples)} if takes_input(estimator, "branches") else {}),
            **({"values": values} if values is not None else {}),
            **a.advantage_options,
        )
        advantages = weight_domains(advantages, view.domain_ids, view.domain_names, a.domain_advantage_weights)
        # per sequence: a per-token estimator's (gae) mean over each sample's trained tokens
        seq_advantages = (
            advantages if advantages.ndim == 1 else (advantages * view.mask).sum(1) / view.mask.sum(1).clamp_min(1)
        )
        advantages = shaped_advantages(
            a,
            view,
            valid,
            advantages,
            mask,
            rewards,
            old,
            entropy,
            ref,
            self._shaping_inputs(samples, view) if a.advantage_shaping else None,
        )
        mu = view.rollout_logp
        for recipe in self.recipes:
            mu = recipe.behaviour_logp(samples, mu, old)
        corr = registry.get("mismatch", a.mismatch.name)(old, mu, mask, **mismatch_overrides(self.cfg))
        weights, keep, mm = corr.weights, corr.mask, corr.metrics
        policy_rows = torch.tensor([s.source == "policy" for s in samples], dtype=torch.bool)
        mm.update(mismatch_metrics(old, view.rollout_logp, view.mask * policy_rows[:, None]))  # the policy's tokens
        for recipe in self.recipes:
            metrics.update(
                recipe.learner_metrics(
                    samples, old, view.rollout_logp, view.mask, weights * keep, seq_advantages, valid
                )
            )
        if self.cfg.data.domains:  # a multi-domain run: the mismatch of each domain's samples too
            mm.update(domain_mismatch_metrics(samples, old, view.rollout_logp, view.mask))
        metrics.update({k: float(v) for k, v in mm.items()})
        metrics["entropy/mean"] = float(masked_mean(entropy, view.mask))
        metrics["advantage/abs_mean"] = float(seq_advantages.abs().mean())
        if a.advantage_shaping:  # per token, over the tokens that train
            metrics["advantage/shaped_abs_mean"] = float(masked_mean(advantages.abs(), mask))
        metrics["rollout/unusable_frac"] = float(1 - view.ok.mean())
        metrics["advantage/too_few_valid_frac"] = too_few_valid_frac(view.group_ids, valid)
        metrics.update(domain_metrics(seq_advantages, rewards, valid, view.domain_ids, view.domain_names))
        sizes = [c for s in samples for c in (s.sampling_mask_counts or [])]
        if sizes:  # sampling-mask replay: how many ids the engine's sampler kept per token
            metrics["rollout/sampling_mask_size_mean"] = sum(sizes) / len(sizes)
            metrics["rollout/sampling_mask_size_max"] = float(max(sizes))
        metrics["rollout/policy_version_min"] = float(view.versions.min())
        metrics["rollout/policy_version_max"] = float(view.versions.max())
        per_seq = {
            "old_logp": old,
            "rollout_logp": mu,
            "is_weights": weights.float(),
            "keep": keep.float(),
            "advantages": advantages.float(),
        }
        if a.aux_losses:  # what the aux losses read per micro-batch (see `loss_fn`)
            per_seq.update(
                aux_rewards=rewards.float(), aux_seq_advantages=seq_advantages.float(), aux_group_ids=view.group_ids
            )
        if teacher is not None:
            self._add_distillation(per_seq, metrics, view, teacher, old, old_topk, entropy, mask, rewards, step)
        if ref is not None:
            per_seq["ref_logp"] = ref
        if values is not None:  # the critic's targets: what the estimator says V should have been
            returns, value_mask = critic_targets(estimator)(
                rewards, view.group_ids, values=values, valid=valid, **steps, **a.advantage_options
            )
            per_seq.update(
                value_old=values.values.float(), value_returns=returns.float(), value_mask=value_mask.float()
            )
            metrics["critic/explained_variance"] = explained_variance(values.values, returns, value_mask)
            metrics["critic/value_mean"] = float(masked_mean(values.values, value_mask))
            metrics["critic/return_mean"] = float(masked_mean(returns, value_mask))
        return per_seq, metrics

    def _critic_values(
        self, samples: Sequence[Sample], view: SequenceView, estimator: Any, metrics: dict[str, float]
    ) -> ValueBatch | None:
        """The critic's values over the batch for an estimator that reads them, else None."""
        if not takes_values(estimator):
            return None
        if self.critic is None:
            raise ValueError(
                f"algorithm.advantage {self.cfg.algorithm.advantage!r} reads a critic; the learner has none"
            )
        start = time.perf_counter()
        values = self.critic.values(samples, view.mask.shape[1]) * view.mask
        metrics["time/critic_values_s"] = time.perf_counter() - start
        return ValueBatch(values, view.mask)

    def _shaping_inputs(self, samples: Sequence[Sample], view: SequenceView) -> dict[str, Any]:
        """The optional inputs of advantage shaping: the sampled ids and π_old's log-probs at given ids
        (a forward over the batch per call, with this batch's routing replay)."""
        n, t = view.mask.shape

        def logp_at(ids: torch.Tensor) -> torch.Tensor:
            wanted = ids.long().reshape(1, 1, -1).expand(n, t, -1).contiguous()
            at_ids = self.token_stats(samples, t, topk_ids=wanted, response_mask=view.mask, routing=self.routing)[2]
            assert at_ids is not None  # asked for (topk_ids)
            return at_ids

        return {"response_ids": response_ids(samples, t), "logp_at": logp_at}

    def replay_routing(self, samples: Sequence[Sample]) -> list | None:
        """R3: the samples' engine routing (shape-checked); otherwise None (natural routing)."""
        if self.replay_mode != "r3":
            return None
        mc = self.cfg.model
        routing_replay.check_samples(samples, mc.num_layers, mc.section(MoEKeys).moe_router_topk)
        return [s.routed_experts for s in samples]

    def _add_distillation(
        self,
        per_seq: dict[str, torch.Tensor],
        metrics: dict[str, float],
        view: Any,
        teacher: Any,
        old: torch.Tensor,
        old_topk: torch.Tensor | None,
        entropy: torch.Tensor,
        mask: torch.Tensor,
        rewards: torch.Tensor,
        step: int,
    ) -> None:
        """Advantage-phase terms into the advantages and the loss mask; what the loss phase needs
        into the per-sample tensors (see `train.distillation`). `student_entropy` is π_old's in
        both phases."""
        d, a = self.cfg.distill, self.cfg.algorithm
        dmask = mask * teacher.mask
        batch = DistillBatch(
            student_logp=old,
            old_logp=old,
            teacher_logp=teacher.logp,
            mask=dmask,
            teacher_topk_logp=teacher.topk_logp,
            student_topk_logp=old_topk,
            teacher_ref_logp=teacher.ref_logp,
            teacher_ref_topk_logp=teacher.ref_topk_logp,
            rewards=rewards,
            group_ids=view.group_ids,
            group_mean_reward=group_mean(rewards, view.group_ids),
            advantages=per_seq["advantages"],
            step=step,
            student_entropy=entropy,
            agg=a.loss_agg,
            norm_length=self.cfg.rollout.max_new_tokens,
        )
        with torch.no_grad():
            adv, token_mask, _ = call_terms([x for x in self.distill if x.phase == "advantage"], batch, metrics)
            start_batch(self.loss_terms, batch, metrics)  # loss-phase states' step; metrics at π_old
        token_mask = torch.ones_like(dmask) if token_mask is None else token_mask
        distilled = dmask * token_mask
        advantages = per_token(per_seq["advantages"], old) if d.rl else torch.zeros_like(old)
        if adv is not None:
            advantages = advantages + adv * dmask
        keep = per_seq["keep"]
        # RL + distillation: the terms' masks act on the distilled tokens only; distillation alone:
        # only distilled tokens count
        per_seq["keep"] = (
            keep * torch.where(dmask > 0, token_mask, torch.ones_like(token_mask)) if d.rl else keep * distilled
        )
        per_seq["advantages"] = advantages.float()
        metrics["distill/scored_frac"] = teacher.scored_frac
        metrics["distill/tokens"] = float(distilled.sum())
        if adv is not None:
            metrics["distill/advantage_abs_mean"] = float(masked_mean(adv.abs(), dmask))
        if self.loss_terms:
            per_seq.update(
                teacher_logp=teacher.logp,
                distill_mask=distilled,
                response_mask=view.mask,
                distill_rewards=rewards.float(),
                distill_group_ids=view.group_ids,
                distill_group_mean_reward=group_mean(rewards, view.group_ids),
                student_entropy=entropy,
            )
            for key, value in (
                ("teacher_topk_ids", teacher.topk_ids),
                ("teacher_topk_logp", teacher.topk_logp),
                ("teacher_ref_logp", teacher.ref_logp),
                ("teacher_ref_topk_logp", teacher.ref_topk_logp),
            ):
                if value is not None:
                    per_seq[key] = value

    def loss_fn(self, batch: dict[str, torch.Tensor], stats: Any) -> tuple:
        a = self.cfg.algorithm
        pos = batch["seq_pos"]
        logp = stats.logprobs.reshape(-1)[pos]
        mask = batch["keep"]
        norm_length = self.cfg.rollout.max_new_tokens
        loss_fn = registry.get("policy_loss", a.policy_loss)
        out = loss_fn(
            logp,
            batch["old_logp"],
            batch["advantages"],
            mask,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip=a.dual_clip,
            is_weights=batch["is_weights"],
            agg=a.loss_agg,
            norm_length=norm_length,
            **a.policy_loss_options,
        )
        total = out.loss_sum
        tokens = mask.sum().detach()
        vals = {k: out.metrics.get(k, torch.zeros(())) * tokens for k in LOSS_METRICS[:4]}
        vals["kl/loss"] = torch.zeros(())
        vals["entropy/loss"] = torch.zeros(())
        if self.ref_chunks is not None and not a.kl_in_reward and a.kl_coef > 0:
            kl_sum, _ = kl_loss(logp, batch["ref_logp"], mask, a.kl_estimator, a.loss_agg, norm_length)
            total = total + a.kl_coef * kl_sum
            vals["kl/loss"] = (kl_estimate(logp.detach(), batch["ref_logp"], a.kl_estimator) * mask).sum()
        if a.entropy_coef > 0:
            ent = stats.entropy.reshape(-1)[pos]
            e_sum, _ = registry.get("entropy", "bonus")(ent, mask, a.entropy_coef, a.loss_agg, norm_length)
            total = total + e_sum
            vals["entropy/loss"] = (ent.detach() * mask).sum()
        for term in self.loss_terms:
            vals[f"distill/{term.name}/loss"] = torch.zeros(())
        if self.loss_terms and logp.numel():
            db = DistillBatch(
                student_logp=logp,
                old_logp=batch["old_logp"],
                teacher_logp=batch["teacher_logp"],
                mask=batch["distill_mask"],
                teacher_topk_logp=batch.get("teacher_topk_logp"),
                student_topk_logp=batch_topk(stats.topk_logprobs, pos),
                teacher_ref_logp=batch.get("teacher_ref_logp"),
                teacher_ref_topk_logp=batch.get("teacher_ref_topk_logp"),
                rewards=batch["distill_rewards"],
                group_ids=batch["distill_group_ids"],
                group_mean_reward=batch["distill_group_mean_reward"],
                advantages=batch["advantages"],
                step=self.step,
                student_entropy=batch["student_entropy"],
                student_ref_logp=batch.get("ref_logp"),
                agg=a.loss_agg,
                norm_length=norm_length,
            )
            for term in self.loss_terms:
                terms = term(db)
                if terms.loss_sum is None:
                    raise ValueError(f"distill.{term.name}: a loss-phase term returned no loss_sum")
                total = total + term.coef * terms.loss_sum
                vals[f"distill/{term.name}/loss"] = terms.loss_sum.detach()
        for aux_term in a.aux_losses:  # e.g. VIMPO's value loss, with the policy loss's aggregation
            vals[f"aux/{aux_term.name}/loss"] = torch.zeros(())
            if logp.numel():
                aux = registry.get("aux_loss", aux_term.name)(
                    logp,
                    old_logp=batch["old_logp"],
                    ref_logp=batch.get("ref_logp"),
                    mask=mask,
                    rewards=batch["aux_rewards"],
                    seq_advantages=batch["aux_seq_advantages"],
                    group_ids=batch["aux_group_ids"],
                    agg=a.loss_agg,
                    norm_length=norm_length,
                    **aux_term.options,
                )
                total = total + aux_term.coef * aux.loss_sum
                vals[f"aux/{aux_term.name}/loss"] = aux.loss_sum.detach()
        count = out.count.detach().round().to(torch.int)
        report = {
            "lm_loss": torch.stack([total.detach().float(), out.count.detach().float()]),
            # A metric a term did not produce is a CPU zero; the report lives on the loss's device.
            "metric_sums": torch.stack(
                [tokens.float()]
                + [vals[k].float().reshape(()).to(total.device) for k in self.metric_keys]
                + [out.count.detach().float().reshape(())]
            ),
        }
        return total, count, report

    def distill_state_dict(self) -> dict[str, Any]:
        """The stateful distillation terms' states (checkpointed with the run)."""
        return terms_state_dict(self.distill)

    def load_distill_state(self, state: dict[str, Any]) -> None:
        load_terms_state(self.distill, state)

    def train(self, samples: Sequence[Sample], step: int) -> tuple[list[dict[str, float]], dict[str, float]]:
        """All optimizer steps of one rollout batch. Returns one metrics dict per optimizer step and
        the batch-level metrics."""
        a, t = self.cfg.algorithm, self.cfg.train
        per_seq, batch_metrics = self.prepare(samples, step)
        self.step = step
        dp_rank, dp_size = _dp()
        num_positions = per_seq["old_logp"].shape[1]
        records: list[dict[str, float]] = []
        parts = [
            part
            for epoch in range(a.ppo_epochs)
            for part in split_minibatches(len(samples), a.num_minibatches, t.seed, step, epoch)
        ]
        # a transient bar under the run's: a real model's step takes minutes
        # the critic's warm-up (algorithm.critic.warmup_steps): it trains, the policy does not step
        warm_up = self.critic is not None and step < a.critic.warmup_steps
        with progress(len(parts), "learner", "minibatch", enabled=self.cfg.logging.progress_bar, leave=False) as bar:
            for part in parts:
                critic = self.critic.train_part(samples, part, per_seq) if self.critic is not None else {}
                if warm_up:
                    records.append({"train/skipped": 1.0, "train/critic_warmup": 1.0})
                else:
                    self._train_minibatch(samples, part, per_seq, num_positions, dp_rank, dp_size, records)
                records[-1].update(critic)
                bar.update()
        routing_replay.clear(self.replay_taps)  # no later forward of the policy replays this batch's experts
        self.routing = None
        return records, batch_metrics

    def _train_minibatch(
        self,
        samples: Sequence[Sample],
        part: Any,
        per_seq: dict[str, Any],
        num_positions: int,
        dp_rank: int,
        dp_size: int,
        records: list[dict[str, float]],
    ) -> None:
        """One optimizer step on the samples of `part`; its metrics record appended to `records`."""
        a, t = self.cfg.algorithm, self.cfg.train
        start = time.perf_counter()
        mbs = build_microbatches(
            samples,
            part,
            t.seq_length,
            t.micro_batch_size,
            dp_rank,
            dp_size,
            self.pad_id,
            num_positions,
            per_seq,
            routing=self.routing,
            sampling_masks=self.cfg.rollout.sampling_mask_replay,
        )
        add_packed_topk(mbs)  # the teacher's top-k ids on the packed grid (loss-phase distillation)
        store: list[dict[str, Any]] = []
        step_fn = make_forward_step(
            self.loss_fn, self.temperature, t.logprob_chunk_size, with_entropy=a.entropy_coef > 0, store=store
        )
        # MTP draft heads: co-trained with weight mtp_heads_coeff, or frozen (0) and only measured:
        # their expected acceptance against the current policy on the rollout's tokens
        heads = MTPForwardStep(a.mtp_heads_loss, a.mtp_heads_coeff, base=step_fn) if self.has_mtp_heads else None
        for c in self.chunks:
            c.train()
        sums = torch.zeros(2 + len(self.metric_keys), dtype=torch.float64)
        kept = float(per_seq["keep"][part].sum())
        if kept == 0:  # nothing to learn from (every token masked): no step
            records.append({"train/skipped": 1.0})
            return
        result = forward_backward(self.chunks, mbs, forward_step=heads or step_fn)
        for rep in store:
            sums += rep["metric_sums"].double().cpu()
        sums = _reduce_last_stage(sums)
        opt = self.optimizer.step()
        tokens = max(float(sums[0]), 1.0)
        rec = {
            "train/loss": result["loss"],
            "train/grad_norm": float(opt["grad_norm"]),
            "train/lr": float(opt["lr"]),
            "train/skipped": float(opt["skipped"]),
            "train/tokens": float(sums[0]),
            "time/train_step_s": time.perf_counter() - start,
        }
        for k, v in zip(self.metric_keys, sums[1:-1].tolist()):
            rec[k] = v / (tokens if k in LOSS_METRICS else max(float(sums[-1]), 1.0))  # distill: per count
        if heads is not None:  # this rank's (the last stage's) rows
            rec.update({f"train/{k}": v for k, v in heads.metrics().items()})
        records.append(rec)
