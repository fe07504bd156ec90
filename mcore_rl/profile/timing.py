"""Step time of a layout: matmul FLOPs at an assumed efficiency, plus communication from message
sizes and link bandwidths, plus the pipeline bubble.

Compute is `mcore_rl.models.flops.train_flops_per_token` (the one FLOPs count, the same the MFU
metric uses) for the tokens a rank processes, divided by TP·CP (its share of each token) and
by peak × `cluster.compute_efficiency`. Collectives use the ring cost: an all-reduce of M bytes
over n ranks moves 2·(n-1)/n·M per rank, an all-gather or reduce-scatter (n-1)/n·M, an
all-to-all (n-1)/n·M, each hop paying the link's latency. TP/SP and EP/CP traffic sits on the
critical path (it is not overlapped here), DP's gradient reduction too (overlap is not on in
the trainer: `overlap_grad_reduce=False`). The bubble is (pp - 1) / (vpp · m) of the pipelined
part (Narayanan et al. 2021).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.flops import is_moe_layer, train_flops_per_token
from mcore_rl.profile.cluster import ClusterSpec
from mcore_rl.profile.layouts import Layout, TrainShape
from mcore_rl.profile.memory import model_state


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_s: float
    cp_s: float
    ep_s: float
    pp_p2p_s: float
    dp_s: float
    bubble_s: float
    bubble_fraction: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_s + self.cp_s + self.ep_s + self.pp_p2p_s + self.dp_s + self.bubble_s

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}


def _collective(cluster: ClusterSpec, bytes_per_rank: float, n: int, stride: int, hops: float) -> float:
    if n <= 1:
        return 0.0
    bandwidth, latency = cluster.link(n, stride)
    return bytes_per_rank / bandwidth + hops * latency


def step_time(
    model: ModelConfig, layout: Layout, shape: TrainShape, cluster: ClusterSpec, num_microbatches: int
) -> StepTime:
    e = 2 if shape.precision == "bf16" else 4
    tp, pp, cp, ep, dp = layout.tp, layout.pp, layout.cp, layout.ep, layout.dp
    m, v = num_microbatches, layout.vpp or 1
    s, b, h = shape.seq_length, shape.micro_batch_size, model.hidden_size
    tokens_per_rank = shape.global_batch_size * s / dp  # this DP replica's tokens, shared by TP x CP x PP
    flops = train_flops_per_token(model, s, shape.recompute) * tokens_per_rank / (tp * cp * pp)
    compute = flops / (cluster.peak_flops(shape.precision) * cluster.compute_efficiency)
    layers = model.num_layers / pp
    fwd_passes = 2 if shape.recompute == "full" else 1  # recomputation repeats the forward's collectives
    # TP: per layer 2 all-gathers + 2 reduce-scatters of [s/cp, b, h] forward (SP), the same backward;
    # without SP they are 2 all-reduces each way (the same bytes on a ring)
    act = s / cp * b * h * e
    tp_bytes = (tp - 1) / tp * act * 4 * (fwd_passes + 1) * layers * m
    tp_time = _collective(cluster, tp_bytes, tp, 1, hops=4 * (fwd_passes + 1) * layers * m * (tp - 1))
    # CP: ring exchange of K and V (all of the other chunks) forward, and their gradients backward
    kv = s / cp * b * model.num_query_groups * model.head_dim * 2 * e
    cp_bytes = (cp - 1) * kv * (fwd_passes + 2) * layers * m
    cp_time = _collective(cluster, cp_bytes, cp, tp, hops=(cp - 1) * (fwd_passes + 2) * layers * m)
    # EP: dispatch and combine all-to-alls of the routed tokens, forward and backward
    moe_layers = sum(1 for i in range(model.num_layers) if is_moe_layer(model, i)) / pp
    routed = s / cp * b * model.section(MoEKeys).moe_router_topk * h * e / (tp if layout.sp else 1)
    ep_bytes = (ep - 1) / ep * routed * 2 * (fwd_passes + 1) * moe_layers * m
    ep_hops = 2 * (fwd_passes + 1) * moe_layers * m * (ep - 1)
    ep_time = _collective(cluster, ep_bytes, ep, layout.expert_tp, hops=ep_hops)
    # PP: one activation (forward) and one gradient (backward) per micro-batch and virtual stage boundary
    p2p = s / cp * b * h * e / (tp if layout.sp else 1)
    pp_time = 0.0
    if pp > 1:
        bandwidth, latency = cluster.link(pp, tp * cp * dp)
        pp_time = 2 * m * v * (p2p / bandwidth + latency)
    # DP: all-reduce of the fp32 grad buffer (dense grads over DP, experts over expert-DP);
    # the distributed optimizer's reduce-scatter + all-gather of bf16 params moves about as much
    state = model_state(model, layout, shape, 0)
    dp_time = _collective(cluster, 2 * (dp - 1) / dp * state.grads, dp, tp * cp, hops=2 * (dp - 1))
    busy = compute + tp_time + cp_time + ep_time + pp_time
    bubble_fraction = (pp - 1) / (v * m) if pp > 1 else 0.0
    return StepTime(compute, tp_time, cp_time, ep_time, pp_time, dp_time, busy * bubble_fraction, bubble_fraction)
