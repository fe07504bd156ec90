#!/usr/bin/env python3
"""LatentMoE cost report: parameters, active parameters, FLOPs and all-to-all bytes per token.

For the three MoE-layer configurations of the LatentMoE paper (arXiv:2601.18089), at a chosen hidden
size d and expert intermediate size m:

    baseline   alpha=1, N=64,  K=6    (standard MoE, no latent projections)
    l-MoE_eff  alpha=4, N=256, K=6    (N' = alpha*N, K kept)
    l-MoE_acc  alpha=4, N=256, K=24   (N' = alpha*N, K' = alpha*K)

every quantity is computed twice and the two are checked against each other:

- *closed form* (the paper, per MoE layer, l = d/alpha, b bytes per element, S_I the shared
  experts' total intermediate size):
    routed params       alpha*N * 3*l*m  = 3*N*d*m
    projections         2*d*l            (W_down, W_up; none for the baseline)
    router              d * N'
    shared experts      3*d*S_I
    active routed       K' * 3*l*m       (eff: 3*K*d*m/alpha, acc: 3*K*d*m = baseline)
    active (layer)      router + projections + active routed + shared
    FLOPs / token       2 * active       (forward matmuls; every active weight is used once)
    all-to-all / token  dispatch K'*l*b + combine K'*l*b   (eff: K*d*b/alpha, acc: K*d*b)
- *measured* on the reference modules the exporter and the embedded engine use
  (`mcore_rl.hf.latent_moe.ReferenceLatentMoeBlock`, `ReferenceSparseMoeBlock` for the
  baseline): parameters by summing `numel` of the module built on the meta device; active
  parameters, FLOPs and dispatched elements from a real forward of T tokens — forward hooks count
  the rows each expert receives (and their width: what an all-to-all carries, once each way), and
  `torch.utils.flop_counter.FlopCounterMode` counts the matmul FLOPs. The routed experts' weights
  are aliased to one real tensor set (values do not change FLOP or row counts), so the report runs
  at full size on a laptop.

The all-to-all figure is the per-token payload to all destinations; with EP ranks and uniform
routing a fraction (EP-1)/EP of it leaves the GPU. megatron-core's alltoall dispatcher also sends
one fp32 routing probability per (token, expert) pair (4*K' bytes), not counted here. The
megatron-side counterparts (parameter counts of the built megatron-core layer, the shapes of the
actual all-to-all buffers under EP=2) are checked in tests/test_latent_moe.py.

Also printed: the paper's hardware principles — the memory-bound threshold t_exp of
2*t*d*m / (d*m + t*(d+m)) >= F/BW_HBM (1418 for d=4096, m=1536 on GB200) and the
comm/compute ratio 5F / (4*m*BW_NVL) (9.04 for m=1536).

    python benchmarks/latent_moe_report.py                        # d=2048, m=1408
    python benchmarks/latent_moe_report.py --d 4096 --m 1536 --shared-intermediate 3072 --bytes 1
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

CONFIGS = {  # name: (alpha, N' = routed experts built, K' = top-k)
    "baseline": (1, 64, 6),
    "eff": (4, 256, 6),
    "acc": (4, 256, 24),
}
QUANTITIES = (
    "params",
    "routed_params",
    "active_params",
    "active_routed_params",
    "flops_per_token",
    "a2a_bytes_per_token",
)


@dataclass(frozen=True)
class Costs:
    params: int  # one MoE layer: router + projections + routed experts + shared experts
    routed_params: int
    active_params: int
    active_routed_params: int
    flops_per_token: int
    a2a_bytes_per_token: int  # dispatch + combine payload of the routed tokens


def closed_form(
    d: int, m: int, alpha: int, num_experts: int, topk: int, shared_intermediate: int = 0, bytes_per_elem: int = 2
) -> Costs:
    """The paper's formulas. `num_experts`, `topk` are N', K' (what is built); l = d / alpha."""
    if d % alpha:
        raise ValueError(f"d={d} is not divisible by alpha={alpha}")
    latent = d // alpha
    routed = num_experts * 3 * latent * m
    projections = 2 * d * latent if alpha > 1 else 0
    router = d * num_experts
    shared = 3 * d * shared_intermediate
    active_routed = topk * 3 * latent * m
    active = router + projections + active_routed + shared
    return Costs(
        params=router + projections + routed + shared,
        routed_params=routed,
        active_params=active,
        active_routed_params=active_routed,
        flops_per_token=2 * active,
        a2a_bytes_per_token=2 * topk * latent * bytes_per_elem,
    )


def build_block(d: int, m: int, alpha: int, num_experts: int, topk: int, shared_intermediate: int = 0):
    """The reference MoE block (LatentMoE for alpha > 1, standard for alpha = 1) on the meta device."""
    from mcore_rl.hf.configuration import McoreRLConfig
    from mcore_rl.hf.latent_moe import ReferenceLatentMoeBlock
    from mcore_rl.hf.modeling import ReferenceSparseMoeBlock

    cfg = McoreRLConfig(
        hidden_size=d,
        intermediate_size=m,
        num_attention_heads=1,
        num_key_value_heads=1,
        num_experts=num_experts,
        num_experts_per_tok=topk,
        moe_intermediate_size=m,
        shared_expert_intermediate_size=shared_intermediate,
        moe_latent_size=d // alpha if alpha > 1 else None,
    )
    with torch.device("meta"):
        if cfg.moe_latent_size:
            return ReferenceLatentMoeBlock(cfg)
        return ReferenceSparseMoeBlock(cfg)


def _materialize_cheaply(block: torch.nn.Module, seed: int) -> None:
    """Real weights for router/projections/shared experts; all routed experts share one set."""
    g = torch.Generator().manual_seed(seed)
    for name, module in block.named_children():
        if name == "experts":
            continue
        module.to_empty(device="cpu")
        for p in module.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    proto = block.experts[0].to_empty(device="cpu")
    for p in proto.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    for expert in block.experts[1:]:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(expert, proj).weight = getattr(proto, proj).weight


def measure(
    d: int,
    m: int,
    alpha: int,
    num_experts: int,
    topk: int,
    shared_intermediate: int = 0,
    bytes_per_elem: int = 2,
    num_tokens: int = 64,
    seed: int = 0,
) -> Costs:
    """Count on the built reference block (see the module doc)."""
    from torch.utils.flop_counter import FlopCounterMode

    block = build_block(d, m, alpha, num_experts, topk, shared_intermediate)
    numel = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731  (a one-line helper, local to this report)
    params = numel(block)  # on meta: no expert aliasing yet
    routed = numel(block.experts)
    expert_numel = [numel(e) for e in block.experts]
    always = params - routed  # router, projections, shared experts: every token uses them

    _materialize_cheaply(block, seed)
    rows = [0] * len(block.experts)
    elems = [0]

    def hook(index: int):
        def fn(module, inputs, output):
            rows[index] += inputs[0].shape[0]
            elems[0] += inputs[0].numel() + output.numel()  # dispatched in, combined back

        return fn

    handles = [e.register_forward_hook(hook(i)) for i, e in enumerate(block.experts)]
    x = torch.randn(num_tokens, d, generator=torch.Generator().manual_seed(seed + 1))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        block(x)
    for h in handles:
        h.remove()
    active_routed = sum(r * n for r, n in zip(rows, expert_numel))
    flops = counter.get_total_flops()
    for name, value in (("active routed params", active_routed), ("FLOPs", flops), ("dispatched elements", elems[0])):
        if value % num_tokens:
            raise AssertionError(f"{name} {value} is not a whole number per token")
    return Costs(
        params=params,
        routed_params=routed,
        active_params=always + active_routed // num_tokens,
        active_routed_params=active_routed // num_tokens,
        flops_per_token=flops // num_tokens,
        a2a_bytes_per_token=elems[0] * bytes_per_elem // num_tokens,
    )


def memory_bound_threshold(d: int, m: int, flops: float = 10e15, hbm_bw: float = 8e12) -> float:
    """Principle I: smallest t_exp with 2*t*d*m / (d*m + t*(d+m)) >= F / BW_HBM (inf: never)."""
    r = flops / hbm_bw
    denominator = 2 * d * m - r * (d + m)  # the intensity tends to 2dm/(d+m) as t grows
    return r * d * m / denominator if denominator > 0 else float("inf")


def comm_compute_ratio(m: int, flops: float = 10e15, nvl_bw: float = 900e9) -> float:
    """Principle II: t_comm / t_comp = 5F / (4 * m * BW_NVL)."""
    return 5 * flops / (4 * m * nvl_bw)


def report(d: int, m: int, shared_intermediate: int = 0, bytes_per_elem: int = 2, configs: dict | None = None) -> dict:
    """{name: {"closed": Costs, "measured": Costs, "ok": bool}} for each configuration."""
    out = {}
    for name, (alpha, n, k) in (configs or CONFIGS).items():
        closed = closed_form(d, m, alpha, n, k, shared_intermediate, bytes_per_elem)
        measured = measure(d, m, alpha, n, k, shared_intermediate, bytes_per_elem)
        out[name] = {
            "alpha": alpha,
            "num_experts": n,
            "topk": k,
            "latent": d // alpha,
            "closed": closed,
            "measured": measured,
            "ok": closed == measured,
        }
    return out


def _fmt(value: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3f}{unit}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=2048, help="hidden size (default 2048, the paper's 16B-A2B)")
    ap.add_argument("--m", type=int, default=1408, help="expert intermediate size (default 1408)")
    ap.add_argument(
        "--shared-intermediate", type=int, default=0, help="total intermediate size of the shared experts (0 = none)"
    )
    ap.add_argument("--bytes", type=int, default=2, help="bytes per dispatched element (bf16: 2)")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args(argv)

    result = report(args.d, args.m, args.shared_intermediate, args.bytes)
    base = result["baseline"]["closed"]
    print(
        f"LatentMoE, one MoE layer: d={args.d}, m={args.m}, shared intermediate="
        f"{args.shared_intermediate}, {args.bytes} B/element"
    )
    print("each cell: closed form | measured on the built modules (ratio to the baseline)\n")
    names = list(result)
    print(f"{'':<22}" + "".join(f"{n:>32}" for n in names))
    print(
        f"{'alpha, N, K, l':<22}"
        + "".join(
            f"{', '.join(str(result[n][k]) for k in ('alpha', 'num_experts', 'topk', 'latent')):>32}" for n in names
        )
    )
    for q in QUANTITIES:
        cells = []
        for n in names:
            c, meas = getattr(result[n]["closed"], q), getattr(result[n]["measured"], q)
            cells.append(f"{f'{_fmt(c)} | {_fmt(meas)} ({c / getattr(base, q):.2f}x)':>32}")
        print(f"{q:<22}" + "".join(cells))
    all_ok = all(r["ok"] for r in result.values())
    print(f"{'check':<22}" + "".join(f"{'ok' if result[n]['ok'] else 'MISMATCH':>32}" for n in names))
    print(
        f"\nPrinciple I  (GB200, F=10 PFLOPs, HBM 8 TB/s): memory-bound below t_exp = "
        f"{memory_bound_threshold(args.d, args.m):.1f} tokens/expert at d={args.d}, m={args.m} "
        f"(notes: 1418 at d=4096, m=1536 -> {memory_bound_threshold(4096, 1536):.1f})"
    )
    print(
        f"Principle II (NVL 900 GB/s): t_comm/t_comp = 5F/(4 m BW) = {comm_compute_ratio(args.m):.2f} "
        f"at m={args.m} (notes: 9.04 at m=1536 -> {comm_compute_ratio(1536):.2f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {k: dict(v, closed=asdict(v["closed"]), measured=asdict(v["measured"])) for k, v in result.items()},
                f,
                indent=2,
            )
    if not all_ok:
        print("closed forms and measurements DISAGREE", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
