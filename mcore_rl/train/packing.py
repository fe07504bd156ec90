"""Batch building: samples -> per-sample [N, T] tensors and packed micro-batches for megatron-core.

Two views of one rollout batch:

* the *sequence view*, [N, T] tensors over N samples and T = the longest response (right-padded,
  `mask` = 1 on response tokens): μ, π_old, π_ref, IS weights, advantages. The algorithms in
  `mcore_rl.algos` work on this view, on the whole batch at once (mismatch corrections with
  batch normalisation, advantages over groups);
* the *packed view* the model runs on: each sample is `prompt ids + response ids`, samples are packed
  into rows of `seq_length + 1` tokens (`tokens = row[:-1]`, `labels = row[1:]`, positions restart
  and segment ids change at every sample, so attention stays inside a sample), rows are grouped
  into micro-batches of `micro_batch_size` and dealt to the data-parallel ranks.

Each micro-batch also carries the sequence view of the samples it holds: `seq_index` [n] (their
positions in the batch) and `seq_pos` [n, T] (for response token j of sample i, the flat index in
the micro-batch's [b × s] grid of the position whose *label* is that token). The loss gathers
π_θ through `seq_pos`, so every algorithm sees [n, T] tensors whatever the packing.

Sampling-mask replay (`sampling_masks=True`): each micro-batch also carries `label_mask_counts`
[b, s] int32 (the support size of the label at each position; 0 = none: prompt positions, padding,
samples without a mask) and `label_mask_ids` int32, all supports' ids flat in row-major [b, s]
order — no padding to the largest support, which at top-p can be thousands of ids next to tens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import torch

from mcore_rl.data.samples import Sample

SEQ_KEYS = ("old_logp", "rollout_logp", "ref_logp", "is_weights", "keep", "advantages")


@dataclass
class SequenceView:
    rollout_logp: torch.Tensor  # [N, T] μ
    mask: torch.Tensor  # [N, T] 1 on response tokens the learner trains (`Sample.trainable`)
    rewards: torch.Tensor  # [N]
    group_ids: torch.Tensor  # [N]
    versions: torch.Tensor  # [N] policy version that generated each sample
    ok: torch.Tensor  # [N] 1 unless the sample is unusable (aborted, reward error when dropped)
    domain_ids: torch.Tensor  # [N] long: index into domain_names
    domain_names: list[str]  # sorted domains of the batch (Prompt.domain)
    reward_heads: torch.Tensor  # [N, H] Sample.reward_heads; NaN where a sample has no such head
    head_names: list[str]  # sorted names of the batch's reward heads

    @property
    def num_samples(self) -> int:
        return self.mask.shape[0]


def sequence_view(samples: Sequence[Sample], drop_reward_errors: bool = True) -> SequenceView:
    """The [N, T] view of a batch, with each sample's domain id and reward-head row (multi-domain,
    multi-reward advantages: `mcore_rl.algos.multi_reward`)."""
    n = len(samples)
    t = max([len(s.response_ids) for s in samples] + [1])
    mu = torch.zeros(n, t)
    mask = torch.zeros(n, t)
    for i, s in enumerate(samples):
        k = len(s.response_ids)
        if k:
            mu[i, :k] = torch.tensor(s.rollout_logp, dtype=torch.float32)
            # a multi-turn episode trains only the model's own tokens (not the observations between them)
            mask[i, :k] = 1.0 if s.trainable is None else torch.tensor(s.trainable, dtype=torch.float32)
    ok = torch.tensor(
        [
            float(
                s.finish_reason != "abort"
                and not (drop_reward_errors and s.reward_error is not None)
                and s.response_ids != []
            )
            for s in samples
        ]
    )
    return SequenceView(
        rollout_logp=mu,
        mask=mask,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.group for s in samples], dtype=torch.long),
        versions=torch.tensor([s.policy_version for s in samples], dtype=torch.long),
        ok=ok,
        **domains_and_heads(samples),
    )


def domains_and_heads(samples: Sequence[Sample]) -> dict[str, Any]:
    """Domain ids [N] into the sorted domain names of the batch, and the reward-head matrix [N, H]
    over the sorted union of head names (NaN where a sample's domain has no such head)."""
    domain_names = sorted({s.prompt.domain for s in samples})
    head_names = sorted({h for s in samples for h in s.reward_heads})
    index = {d: i for i, d in enumerate(domain_names)}
    heads = torch.full((len(samples), len(head_names)), float("nan"))
    for i, s in enumerate(samples):
        for j, h in enumerate(head_names):
            if h in s.reward_heads:
                heads[i, j] = float(s.reward_heads[h])
    return dict(
        domain_ids=torch.tensor([index[s.prompt.domain] for s in samples], dtype=torch.long),
        domain_names=domain_names,
        reward_heads=heads,
        head_names=head_names,
    )


@dataclass
class Placement:
    """Where sample i of the packed subset lives: row, and the column of its first token."""

    row: int
    col: int


def pack_rows(
    samples: Sequence[Sample], order: Sequence[int], seq_length: int
) -> tuple[list[list[int]], list[Placement]]:
    """Greedy in-order packing of samples `order` into rows of seq_length + 1 tokens."""
    width = seq_length + 1
    rows: list[list[int]] = []
    used: list[int] = []
    places: list[Placement] = []
    for i in order:
        n = len(samples[i].prompt_ids) + len(samples[i].response_ids)
        if n > width:
            raise ValueError(f"a sample of {n} tokens does not fit in a row of train.seq_length + 1 = {width}")
        if not rows or used[-1] + n > width:
            rows.append([])
            used.append(0)
        places.append(Placement(len(rows) - 1, used[-1]))
        rows[-1].append(i)
        used[-1] += n
    return rows, places


def build_microbatches(
    samples: Sequence[Sample],
    order: Sequence[int],
    seq_length: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    pad_id: int,
    num_positions: int,
    per_seq: dict[str, torch.Tensor] | None = None,
    routing: Sequence[torch.Tensor | None] | None = None,
    sampling_masks: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches for the samples `order` (indices into `samples`).

    Row r goes to micro-batch r // (mbs·dp) of rank (r // mbs) % dp; the row count is padded with
    empty rows so every rank runs the same number of micro-batches. `per_seq` tensors ([N, ...],
    indexed by sample) are sliced to each micro-batch's samples. `num_positions` is T of the
    sequence view. `routing` (MoE routing replay, indexed like `samples`: [m, layers, k] per sample,
    m <= its token count) becomes each micro-batch's `routed_experts` [b, s, layers, k] on the
    token grid (-1 where none: padding, tokens past m). `sampling_masks`: add the samples' supports
    (see the module docstring)."""
    rows, places = pack_rows(samples, order, seq_length)
    masks_by_row: dict[int, list[tuple[int, list[int], list[int]]]] = {}  # row -> (first label col, counts, ids)
    per_step = micro_batch_size * dp_size
    num_rows = max(1, -(-len(rows) // per_step)) * per_step
    width = seq_length + 1
    ids = torch.full((num_rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((num_rows, width), dtype=torch.long)
    seg = torch.zeros((num_rows, width), dtype=torch.long)
    target = torch.zeros((num_rows, width), dtype=torch.bool)
    trained = torch.zeros((num_rows, width), dtype=torch.bool)  # the response tokens the learner trains
    seq_pos_rows: list[tuple[int, int, torch.Tensor]] = []  # (sample, row, flat positions within row)
    for i, place in zip(order, places):
        s = samples[i]
        p, rsp = s.prompt_ids, s.response_ids
        n = len(p) + len(rsp)
        c = place.col
        ids[place.row, c : c + n] = torch.tensor(p + rsp)
        pos[place.row, c : c + n] = torch.arange(n)
        seg[place.row, c : c + n] = int(seg[place.row].max()) + 1
        target[place.row, c + len(p) : c + n] = True
        trained[place.row, c + len(p) : c + n] = (
            True if s.trainable is None else torch.tensor(s.trainable, dtype=torch.bool)
        )
        # response token j sits at c + len(p) + j; its label position is one before
        label_pos = torch.zeros(num_positions, dtype=torch.long)
        label_pos[: len(rsp)] = c + len(p) - 1 + torch.arange(len(rsp))
        seq_pos_rows.append((i, place.row, label_pos))
        if sampling_masks and s.sampling_mask_counts is not None:
            if len(s.sampling_mask_counts) != len(rsp) or len(s.sampling_mask_ids or []) != sum(s.sampling_mask_counts):
                raise ValueError(
                    f"sample {i}: {len(s.sampling_mask_counts)} sampling-mask counts for {len(rsp)} "
                    f"response tokens, {len(s.sampling_mask_ids or [])} ids for {sum(s.sampling_mask_counts)}"
                )
            masks_by_row.setdefault(place.row, []).append(
                (
                    c + len(p) - 1,
                    s.sampling_mask_counts,
                    s.sampling_mask_ids or [],
                )  # (checked above: as many as counted)
            )
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    loss_mask = target[:, 1:].float()
    stats_mask = trained[:, 1:].contiguous()  # log-probs and entropy only there (train/logprobs.py)
    by_row: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, row, lp in seq_pos_rows:
        by_row.setdefault(row, []).append((i, lp))
    out = []
    for start in range(0, num_rows, per_step):
        lo = start + dp_rank * micro_batch_size
        rows_here = range(lo, lo + micro_batch_size)
        mb = {
            "tokens": tokens[lo : lo + micro_batch_size],
            "labels": labels[lo : lo + micro_batch_size],
            "loss_mask": loss_mask[lo : lo + micro_batch_size],
            "stats_mask": stats_mask[lo : lo + micro_batch_size],
            "position_ids": pos[lo : lo + micro_batch_size, :-1].contiguous(),
            "segment_ids": seg[lo : lo + micro_batch_size, :-1].contiguous(),
        }
        idx: list[int] = []
        flat: list[torch.Tensor] = []
        for b, row in enumerate(rows_here):
            for i, lp in by_row.get(row, []):
                idx.append(i)
                flat.append(lp + b * seq_length)
        if sampling_masks:
            counts = torch.zeros(micro_batch_size, seq_length, dtype=torch.int32)
            flat_ids: list[int] = []
            for b, row in enumerate(rows_here):
                for col, cnt, mids in masks_by_row.get(row, []):  # in column order: row-major ids
                    counts[b, col : col + len(cnt)] = torch.tensor(cnt, dtype=torch.int32)
                    flat_ids += mids
            mb["label_mask_counts"] = counts
            mb["label_mask_ids"] = torch.tensor(flat_ids, dtype=torch.int32)
        mb["seq_index"] = torch.tensor(idx, dtype=torch.long)
        mb["seq_pos"] = torch.stack(flat) if flat else torch.zeros(0, num_positions, dtype=torch.long)
        for key, value in (per_seq or {}).items():
            mb[key] = value[mb["seq_index"]]
        if routing is not None:  # routing replay: the experts per token on the packed grid
            from mcore_rl.train.routing_replay import ROUTING_KEY, packed_grid  # lazy: import cycle

            here = [
                (i, r - lo, place.col)
                for i, place in zip(order, places)
                for r in [place.row]
                if lo <= r < lo + micro_batch_size
            ]
            mb[ROUTING_KEY] = packed_grid(samples, routing, here, micro_batch_size, seq_length)
        out.append(mb)
    return out


def split_minibatches(num: int, num_minibatches: int, seed: int, step: int, epoch: int) -> list[list[int]]:
    """A seeded shuffle of range(num) cut into `num_minibatches` near-equal parts."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + step * 1009 + epoch)
    perm = torch.randperm(num, generator=g).tolist()
    size, extra = divmod(num, num_minibatches)
    out, start = [], 0
    for k in range(num_minibatches):
        end = start + size + (1 if k < extra else 0)
        out.append(perm[start:end])
        start = end
    return out
