"""Speculative decoding in the embedded engine: acceptance and tokens/s against plain decoding.

    .venv/bin/python benchmarks/bench_speculative.py                                # demo model
    .venv/bin/python benchmarks/bench_speculative.py --model-path runs/smollm2/hf   # SmolLM2-135M (HF dir)

For each batch size and draft kind, B requests (prompts that quote a passage and ask for it again,
so prompt lookup has something to find, cycled to B) run to `--new-tokens` tokens each (eos
ignored) at `--temperature` (1.0: RL rollouts), plain and speculative alternately within each round
(the order swaps every round). Printed per row: the acceptance rate (accepted drafts / drafted),
the mean tokens per target forward (emitted / verification passes: accepted drafts + the
residual's or the bonus token), tokens/s of both (median over `--rounds`, and the spread min-max),
and the ratio of the medians.

`--schedules fixed dspark` runs each speculative row with both schedules (plain, fixed and DSpark's
confidence schedule in rotating order within each round): `dspark` verifies per request the prefix of
its drafts that maximises the expected tokens per second at the batch (`rollout/engine/spec_schedule.py`);
its measured pass times and the engine-wide acceptance (the prior of a fresh request's confidence) are
kept across the runs of one draft kind and schedule (a deployment's profile, as the paper's), primed
by the warm-up runs. The row then adds the share of drafts the schedule did not verify. `head` is
DSpark's schedule reading the trained confidence head `--confidence-head` (a JSON of
`tools/train_confidence_head.py`) instead of each request's acceptance so far.

Draft kinds: `ngram` (prompt lookup, 1..3-grams) and `standalone` with the target's first
`--draft-layers` layers as the draft model (its embeddings, final norm and head; a layer-skip
draft, the only smaller model of the same tokenizer at hand), optionally with `--draft-noise`. Both are exact: the output
distribution is the target's either way (tests/test_speculative.py).

The machine's limits, measured at the start of the run with the same thread count: the copy
bandwidth (a 64 MiB copy) and the matmul peak (square fp32 matmuls of side 2048). A decode step reads every weight once for the whole batch and spends 2 FLOPs per
weight per token, so plain decoding's tokens/s at batch B is bounded by the roofline
min(B * bandwidth / weight bytes, matmul peak / (2 * weights per token)) (attention over the short
contexts here is ignored): the bandwidth side binds at batch 1, the matmul side at batch 64. Each row
prints that bound and the share of it plain and speculative decoding reached.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

PASSAGES = [
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "The quick brown fox jumps over the lazy dog. The dog does not move.",
    "for i in range(10):\n    total += values[i] * weights[i]\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
]


def load_target(path: str | None, seed: int):
    """(model, tokenizer) of `path` (an HF directory), or the demo model and the byte tokenizer."""
    from mcore_rl.rollout.engine.core import EngineCore

    engine = EngineCore.from_model_path(path, max_total_tokens=1 << 14, random_seed=seed)
    return engine.model, engine.tokenizer


def layer_skip_draft(model, layers: int, noise: float = 0.0):
    """The target's first `layers` decoder layers, its embeddings, final norm and head, plus Gaussian
    noise of std `noise` on every weight (seeded; the same draft as tools/train_confidence_head.py's)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if noise > 0:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return draft


def prompts_for(tokenizer, batch: int) -> list[list[int]]:
    texts = [f"Copy this text exactly.\n{p}\nCopy:\n{p[: len(p) // 3]}" for p in PASSAGES]
    return [tokenizer.encode(texts[i % len(texts)]) for i in range(batch)]


def run_once(model, tokenizer, prompts, args, spec, draft, profile=None) -> tuple[float, dict[str, int]]:
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams

    longest = max(len(p) for p in prompts)
    engine = EngineCore(
        model,
        tokenizer,
        max_running_requests=len(prompts),
        context_length=longest + args.new_tokens + 1,
        max_total_tokens=len(prompts) * (longest + args.new_tokens + 16),
        speculative=spec,
        draft_model=draft,
    )
    if profile is not None:  # DSpark's schedule: the deployment's pass times and acceptance
        engine.spec_cost, engine.spec_acceptance = profile
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True, seed=i)
        engine.add_request(Request(str(i), p, sp))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0, dict(engine.spec_stats)


def copy_bandwidth() -> float:
    """Bytes per second of a large device copy (read + write counted once each)."""
    src = torch.empty(64 * 2**20 // 4)  # 64 MiB of fp32
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times)


def matmul_peak(n: int) -> float:
    """FLOP/s of square fp32 matmuls of side `n` (median of 7, after a warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def roofline(batch: int, bandwidth: float, peak: float, weight_bytes: int, weights: int) -> float:
    """Plain decoding's bound in tokens/s at `batch`: weights read once a step, 2 FLOPs per weight a token."""
    return min(batch * bandwidth / weight_bytes, peak / (2 * weights))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="HF directory of the target (default: the demo model)")
    ap.add_argument("--kinds", nargs="+", default=["ngram", "standalone"], choices=["ngram", "standalone"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--num-steps", type=int, default=4, help="tokens drafted per verification")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-noise", type=float, default=0.0, help="standalone: add N(0, s^2) to the draft's weights")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedules", nargs="+", default=["fixed"], choices=["fixed", "dspark", "head"])
    ap.add_argument("--confidence-head", help="schedule `head`: DSpark's schedule with this trained head (JSON)")
    args = ap.parse_args()
    if "head" in args.schedules and not args.confidence_head:
        ap.error("--schedules head needs --confidence-head")
    torch.set_num_threads(args.threads)
    from mcore_rl.rollout.engine.spec_schedule import AcceptanceRate, StepCost
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings

    model, tokenizer = load_target(args.model_path, args.seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = sum(p.numel() for p in model.parameters())
    bw = copy_bandwidth()
    peak = matmul_peak(2048)
    print(
        f"target {args.model_path or 'demo'}: {weight_bytes / 2**20:.1f} MiB of weights; copy bandwidth "
        f"{bw / 2**30:.1f} GiB/s -> batch-1 bound {bw / weight_bytes:,.0f} tokens/s; matmul peak "
        f"{peak / 1e9:,.1f} GFLOP/s -> compute bound {peak / (2 * weights):,.0f} tokens/s; {args.threads} thread(s), "
        f"{args.new_tokens} new tokens, temperature {args.temperature}, k={args.num_steps}, {args.rounds} rounds"
    )
    print(
        "| draft | schedule | batch | acceptance | tokens per request and target forward | drafts cut "
        "| plain tok/s (min-max) | spec tok/s (min-max) | spec / plain | roofline tok/s | plain / roofline "
        "| spec / roofline |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in args.kinds:
        draft = layer_skip_draft(model, args.draft_layers, args.draft_noise) if kind == "standalone" else None
        specs = {
            sch: SpeculativeSettings(
                kind.upper(),
                num_steps=args.num_steps,
                schedule="dspark" if sch == "head" else sch,
                confidence_head=args.confidence_head if sch == "head" else None,
            )
            for sch in args.schedules
        }
        profiles = {sch: (StepCost(), AcceptanceRate()) for sch in args.schedules}
        for batch in args.batches:
            prompts = prompts_for(tokenizer, batch)
            for sch, spec in specs.items():  # warm-up (and DSpark's profile: every batch size seen)
                run_once(copy.deepcopy(model), tokenizer, prompts, args, spec, copy.deepcopy(draft), profiles[sch])
            sides = ["plain", *specs]
            rates: dict[str, list[float]] = {side: [] for side in sides}
            stats: dict[str, dict[str, int]] = {}
            for r in range(args.rounds):
                for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                    spec = specs.get(side)
                    dt, got = run_once(
                        copy.deepcopy(model),
                        tokenizer,
                        prompts,
                        args,
                        spec,
                        copy.deepcopy(draft) if spec is not None else None,
                        profiles[side] if side in ("dspark", "head") else None,
                    )
                    rates[side].append(batch * args.new_tokens / dt)
                    if spec is not None:
                        stats[side] = got
            p = statistics.median(rates["plain"])
            for side in specs:
                st = stats[side]
                accept = st["accepted"] / max(1, st["drafted"])
                per_forward = st["emitted"] / max(1, st["rows_verified"])
                cut = st.get("cut", 0) / max(1, st["drafted"] + st.get("cut", 0))
                s = statistics.median(rates[side])
                bound = roofline(batch, bw, peak, weight_bytes, weights)
                print(
                    f"| {kind} | {side} | {batch} | {accept:.2f} | {per_forward:.2f} | {cut:.2f} | {_rate(p)} "
                    f"({_rate(min(rates['plain']))}-{_rate(max(rates['plain']))}) | {_rate(s)} "
                    f"({_rate(min(rates[side]))}-{_rate(max(rates[side]))}) | {s / p:.2f}x | {_rate(bound)} "
                    f"| {p / bound:.2f} | {s / bound:.2f} |",
                    flush=True,
                )


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


if __name__ == "__main__":
    main()
