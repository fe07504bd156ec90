"""MoE routing replay in megatron-core's router: R3 (the engine's experts) and R2 (the trainer's own).

An MoE model's log-probs are discontinuous in its routing: an FP8 engine and the fp32 trainer that
pick different experts for a token compute different functions, and no importance weight fixes
that. Routing replay makes the trainer route each token to the experts a reference pass chose:

* **R3** (`algorithm.routing_replay: r3`): the engine's own choice, `Sample.routed_experts`
  (SGLang's `return_routed_experts`, [len(prompt) + len(response) - 1, layers, k]), replayed in the
  π_old recompute and every training forward;
* **R2** (`r2`): the π_old recompute routes naturally and records its choice; the training forwards
  of the same batch (every mini-batch, every epoch) replay it, so the policy ratio compares the same
  experts even after the optimizer moved the router.

The reference model (π_ref) and in-trainer teachers are other model instances and always route
naturally: their own routing is what defines their distributions.

How it plugs in. megatron-core's `TopKRouter.routing` hands `self.router_replay` to
`topk_routing_with_score_function`, which asks it for the top-k (`get_replay_topk`). `attach` gives
each router of the policy's chunks its own `ReplayRouting` (not megatron's global list, which would
reach every model in the process); `install`, called from `make_forward_step` once per micro-batch
per stage, sets each router's target from the micro-batch's `routed_experts` [b, s, layers, k]:
the router sees the [s, b, h] hidden states flattened s-major, under sequence parallelism only this
TP rank's s/TP slice, and under pipeline parallelism each stage holds only its layers (a router
knows its global `layer_number`). Expert ids are global (the router runs before the EP dispatch),
so EP and ETP need nothing else. Rows whose first id is -1 (padding, each sample's last token, a
token the engine did not forward) route naturally. Replayed probabilities are the router's scores
gathered at the replayed ids, so the gradient reaches the router weights of the chosen experts, and
the load-balancing loss (computed from its own top-k in `compute_routing_scores_for_aux_loss`)
stays defined.

Not supported: `train.recompute: full` (the backward's recomputed forward would read another
micro-batch's target; refused by the config check) and megatron's fused TE router (the CPU/local
path is the unfused one; with `moe_router_fusion` megatron ignores `router_replay`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator, Sequence

if TYPE_CHECKING:  # annotations only: megatron-core is imported after the CPU compatibility layer patched it
    from megatron.core.transformer.moe.router import TopKRouter

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay

from mcore_rl.data.samples import Sample
from mcore_rl.train.packing import pack_rows

ROUTING_KEY = "routed_experts"  # the micro-batch key: int [b, s, layers, k], -1 = route naturally


class ReplayRouting(RouterReplay):
    """One router's replay: its target ids for the current micro-batch, and what it used.

    Not registered in `RouterReplay.global_router_replay_instances` (megatron's static list), so
    only the router it is attached to sees it."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # global 0-based layer index
        self.target: torch.Tensor | None = None  # [tokens, k] long; rows of -1 route naturally
        self.record = False
        self.recorded: list[torch.Tensor] = []  # [tokens, k] int32 per forward, in call order
        # what megatron's base class reads
        self.target_topk_idx = self.recorded_topk_idx = self.router_replay_action = None
        self.replay_backward_list: list[torch.Tensor] = []

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target
        if target is not None:
            if tuple(target.shape) != tuple(idx.shape):
                raise ValueError(
                    f"{ROUTING_KEY}: layer {self.layer} has {tuple(target.shape)} replay ids for a router "
                    f"input of {tuple(idx.shape)} (tokens x topk)"
                )
            target = target.to(device=idx.device, dtype=idx.dtype)
            rows = target[:, 0] >= 0
            idx = torch.where(rows[:, None], target, idx)
            values = scores.gather(1, idx)  # megatron's RouterReplay: the scores at the replayed ids
        if self.record:
            self.recorded.append(idx.detach().to("cpu", torch.int32))
        return values, idx


def _routers(chunk: torch.nn.Module) -> list[TopKRouter]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


def attach(chunks: Sequence[torch.nn.Module]) -> list[ReplayRouting]:
    """Give every router of `chunks` (one model's pipeline chunks) its `ReplayRouting`; returns them.
    Raises ValueError when the chunks hold no MoE router (a dense model)."""
    from mcore_rl.train.logprobs import unwrap_gpt  # lazy: yaml

    taps = []
    for chunk in chunks:
        gpt = unwrap_gpt(chunk)
        mine = []
        for router in _routers(gpt):
            if router.layer_number is None:
                raise ValueError(
                    "algorithm.routing_replay: a router without a layer number (not in a TransformerLayer)"
                )
            router.router_replay = ReplayRouting(int(router.layer_number) - 1)
            mine.append(router.router_replay)
        gpt._routing_replay = mine
        taps += mine
    if not taps and chunks:
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            raise ValueError("algorithm.routing_replay: the policy has no MoE router to replay (a dense model)")
    return taps


def install(model: torch.nn.Module, routing: torch.Tensor | None) -> None:
    """Set the replay target of every router in `model` (one chunk) from a micro-batch's
    `routed_experts` [b, s, layers, k]; None clears them (natural routing). No-op for a model
    without `attach`ed replay (π_ref, teachers)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.train.logprobs import unwrap_gpt  # lazy: yaml

    gpt = unwrap_gpt(model)
    taps: list[ReplayRouting] = getattr(gpt, "_routing_replay", None) or []
    if not taps:
        return
    if routing is None:
        for tap in taps:
            tap.target = None
        return
    cfg = gpt.config
    b, s, layers, k = routing.shape
    if layers != cfg.num_layers or k != cfg.moe_router_topk:
        raise ValueError(
            f"{ROUTING_KEY}: micro-batch routing has {layers} layers x top-{k}, the policy "
            f"{cfg.num_layers} layers x top-{cfg.moe_router_topk} (model.num_layers, model.moe_router_topk)"
        )
    rows = routing.permute(1, 0, 2, 3)  # [s, b, layers, k]: the router's s-major token order
    tp = ps.get_tensor_model_parallel_world_size()
    if cfg.sequence_parallel and tp > 1:
        chunk = s // tp
        rank = ps.get_tensor_model_parallel_rank()
        rows = rows[rank * chunk : (rank + 1) * chunk]
    for tap in taps:
        tap.target = rows[:, :, tap.layer].reshape(-1, k).long()


def clear(taps: Sequence[ReplayRouting]) -> None:
    for tap in taps:
        tap.target = None
        tap.recorded = []


@contextlib.contextmanager
def recording(taps: Sequence[ReplayRouting]) -> Iterator[None]:
    """Record the ids every router uses (replayed or natural) while inside."""
    for tap in taps:
        tap.record, tap.recorded = True, []
    try:
        yield
    finally:
        for tap in taps:
            tap.record = False


# ------------------------------------------------------------------------------ per-sample data


def check_samples(samples: Sequence[Sample], num_layers: int, topk: int) -> None:
    """Every sample has engine routing of SGLang's shape [prompt + response - 1, layers, k];
    ValueError naming the sample and the shapes otherwise (R3, at the first batch)."""
    for i, smp in enumerate(samples):
        n = len(smp.prompt_ids) + len(smp.response_ids)
        r = smp.routed_experts
        want = (n - 1, num_layers, topk)
        if r is None:
            raise ValueError(
                f"algorithm.routing_replay=r3: sample {i} (prompt {smp.prompt.index}, engine "
                f"{smp.engine or '?'}) has no routed_experts; the engine must return them "
                "(SGLang: --enable-return-routed-experts)"
            )
        if tuple(r.shape) != want:
            raise ValueError(
                f"algorithm.routing_replay=r3: sample {i} (prompt {smp.prompt.index}) has routed_experts "
                f"of shape {tuple(r.shape)}, expected {want} = (len(prompt) + len(response) - 1, "
                f"model.num_layers, model.moe_router_topk)"
            )


def packed_grid(
    samples: Sequence[Sample],
    routing: Sequence[torch.Tensor | None],
    rows: Sequence[tuple[int, int, int]],
    micro_batch_size: int,
    seq_length: int,
) -> torch.Tensor:
    """One micro-batch's `routed_experts` [b, s, layers, k] int16/int32: sample i at (row b, column
    c) puts its per-token routing ([m, layers, k], m <= its token count) at columns c.. of row b;
    everything else is -1. `rows`: (sample index, row within the micro-batch, first column)."""
    first = next((r for r in routing if r is not None), None)
    if first is None:
        raise ValueError(f"{ROUTING_KEY}: no sample of the batch has routing to replay")
    layers, k = first.shape[1:]
    grid = torch.full((micro_batch_size, seq_length, layers, k), -1, dtype=first.dtype)
    for i, b, c in rows:
        r = routing[i]
        if r is None:
            continue
        m = min(r.shape[0], seq_length - c)
        grid[b, c : c + m] = r[:m].to(grid.dtype)
    return grid


def microbatch_rows(
    samples: Sequence[Sample], order: Sequence[int], seq_length: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[tuple[int, int, int]]]:
    """For each of this DP rank's micro-batches (as `build_microbatches` deals them): its samples
    as (sample index, row within the micro-batch, first column)."""
    rows, places = pack_rows(samples, order, seq_length)
    per_step = micro_batch_size * dp_size
    num_rows = max(1, -(-len(rows) // per_step)) * per_step
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(num_rows // per_step)]
    for i, place in zip(order, places):
        r = place.row
        if (r // micro_batch_size) % dp_size == dp_rank:
            out[r // per_step].append((i, r % micro_batch_size, place.col))
    return out


def gather_recorded(
    taps: Sequence[ReplayRouting],
    samples: Sequence[Sample],
    order: Sequence[int],
    seq_length: int,
    micro_batch_size: int,
    num_layers: int,
    topk: int,
) -> list[torch.Tensor]:
    """The routing the policy's routers used in the last recorded pass over the micro-batches of
    `order`, per sample: int32 [len(prompt) + len(response), layers, k] (a token cut off by the row
    end stays -1), identical on every rank (collective over the trainer world).

    Each rank knows its micro-batches (DP), its sequence slice (SP) and its layers (PP); every other
    entry is -1 and one max-all-reduce over the world fills them in."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in range(len(samples))]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    flat = torch.full((offsets[-1], num_layers, topk), -1, dtype=torch.int32)
    tp = ps.get_tensor_model_parallel_world_size()
    by_mb = microbatch_rows(samples, order, seq_length, micro_batch_size, dp_rank, dp_size)
    for tap in taps:
        if len(tap.recorded) != len(by_mb):
            raise RuntimeError(
                f"routing replay: layer {tap.layer} recorded {len(tap.recorded)} forwards for "
                f"{len(by_mb)} micro-batches"
            )
        for rec, mb_rows in zip(tap.recorded, by_mb):
            s_local = rec.shape[0] // micro_batch_size
            grid = rec.view(s_local, micro_batch_size, topk)  # [s_local, b, k]
            start = ps.get_tensor_model_parallel_rank() * s_local if (s_local != seq_length and tp > 1) else 0
            for i, b, c in mb_rows:
                lo, hi = max(c, start), min(c + lengths[i], start + s_local, seq_length)
                if lo < hi:
                    flat[offsets[i] + lo - c : offsets[i] + hi - c, tap.layer] = grid[lo - start : hi - start, b]
    if dist.is_initialized() and dist.get_world_size() > 1:
        buf = flat.to(_comm_device())
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        flat = buf.cpu()
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(samples))]


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
