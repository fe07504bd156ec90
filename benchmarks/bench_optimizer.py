"""Time one AdamW step on CPU: DeepSpeedCPUAdam vs torch.optim.AdamW (foreach on/off).

Why: `optimizer.backend` picks the inner kernel; this measures what the choice is worth on the
machine at hand, and what the project's wrapper (grad norm, clipping) adds on top. The optimizers
are stepped round-robin, so load from other processes on a shared machine hits them alike; the
median and the minimum are both printed.

    .venv/bin/python benchmarks/bench_optimizer.py            # 20M fp32 params, median of 20 steps
    .venv/bin/python benchmarks/bench_optimizer.py --params 5e6 --steps 50 --no-wrapper

Parameters are split like a small decoder (hidden 512: qkv, out-proj, fc1, fc2 and two norm
weights per layer, then an embedding for the rest), a few dozen tensors in all. DeepSpeed's op
JIT-compiles on first use (about a minute, cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def layout(total: int, hidden: int = 512) -> list[tuple[int, ...]]:
    """Shapes of a decoder-like parameter set with about `total` elements."""
    per_layer = [
        (3 * hidden, hidden),
        (hidden, hidden),
        (4 * hidden, hidden),
        (hidden, 4 * hidden),
        (hidden,),
        (hidden,),
    ]
    layer_numel = sum(torch.Size(s).numel() for s in per_layer)
    n_layers = max(1, (total - 1000 * hidden) // layer_numel)
    shapes = per_layer * n_layers
    rest = total - n_layers * layer_numel
    if rest >= hidden:
        shapes.append((rest // hidden, hidden))
    if rest % hidden:
        shapes.append((rest % hidden,))
    return shapes


def make_params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        params.append(p)
    return params


def inner_step(name: str, shapes) -> Callable[[], object]:
    params = make_params(shapes)
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if name == "deepspeed":
        from mcore_rl.train.optimizer import load_deepspeed_cpu_adam

        return load_deepspeed_cpu_adam()(params, adamw_mode=True, **kw).step
    return torch.optim.AdamW(params, foreach=(name == "torch-foreach"), **kw).step


def wrapper_step(backend: str, shapes) -> Callable[[], object]:
    """The project's optimizer: grad collection, global norm, clipping, AdamW, LR schedule."""
    from mcore_rl.config.schema import OptimizerConfig
    from mcore_rl.train.optimizer import build_optimizer

    module = torch.nn.Module()
    module.params = torch.nn.ParameterList(make_params(shapes))
    cfg = OptimizerConfig(backend=backend, lr=1e-4, weight_decay=0.1, clip_grad=1.0)
    return build_optimizer([module], cfg, "fp32", total_iters=10_000).step


def time_interleaved(steps: dict[str, Callable[[], object]], warmup: int, n: int) -> dict[str, list[float]]:
    """Round-robin over the optimizers, so that load from other processes on a shared machine
    lands on all of them alike; milliseconds per step."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(n):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=20e6, help="number of fp32 parameters")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-wrapper", action="store_true", help="skip the mcore_rl wrapper rows")
    args = ap.parse_args()

    shapes = layout(int(args.params))
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(
        f"{numel / 1e6:.2f}M fp32 params in {len(shapes)} tensors; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {args.steps} steps after {args.warmup} "
        "warmup"
    )

    steps: dict[str, Callable[[], object]] = {}
    try:
        steps["DeepSpeedCPUAdam(adamw_mode=True)"] = inner_step("deepspeed", shapes)
    except RuntimeError as exc:
        print(f"DeepSpeedCPUAdam unavailable: {exc}")
    has_ds = bool(steps)
    steps["torch.optim.AdamW(foreach=True)"] = inner_step("torch-foreach", shapes)
    steps["torch.optim.AdamW(foreach=False)"] = inner_step("torch-loop", shapes)
    if not args.no_wrapper:
        if has_ds:
            steps["ModelParallelAdamW(backend=deepspeed)"] = wrapper_step("deepspeed", shapes)
        steps["ModelParallelAdamW(backend=torch)"] = wrapper_step("torch", shapes)

    times = time_interleaved(steps, args.warmup, args.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["torch.optim.AdamW(foreach=True)"]
    print(f"{'optimizer':40s} {'median ms':>10s} {'min ms':>8s} {'speedup vs torch foreach':>25s}")
    for name, ms in med.items():
        print(f"{name:40s} {ms:10.2f} {min(times[name]):8.2f} {ref / ms:24.2f}x")


if __name__ == "__main__":
    main()
