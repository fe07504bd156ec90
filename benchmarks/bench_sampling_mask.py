"""Cost of sampling-mask replay: chunked log-probs + entropy, forward and backward, with each token's
softmax renormalised over its top-p support vs over the full vocabulary.

Both sides run `mcore_rl.train.logprobs.vocab_parallel_topk_stats` on the same hidden states,
output weight and targets (TP=1, fp32, CPU), alternating plain / masked for `--repeats` rounds so
that drift of a shared machine hits both alike. Supports are drawn log-uniformly between
`--min-support` and `--max-support` ids per token (top-p 0.9 of a trained LM: tens to thousands),
each holding its target. Time is the wall clock of forward + backward; memory is the peak RSS above
the level before the call (a 1 ms sampling thread on /proc/self/statm: the torch CPU allocator is
invisible to tracemalloc), i.e. what the call allocates on top of its inputs.

    python benchmarks/bench_sampling_mask.py                    # vocab 151936, 8192 tokens, hidden 64
    python benchmarks/bench_sampling_mask.py --tokens 1024 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from mcore_rl.train.logprobs import auto_chunk_size, vocab_parallel_topk_stats

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak resident set size above the starting level while the block runs."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def delta_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def supports(targets: torch.Tensor, vocab: int, lo: int, hi: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ids and counts: log-uniform sizes in [lo, hi], random ids, the target always in."""
    g = torch.Generator().manual_seed(seed)
    n = targets.numel()
    sizes = torch.exp(
        torch.empty(n).uniform_(
            torch.log(torch.tensor(float(lo))).item(), torch.log(torch.tensor(float(hi))).item(), generator=g
        )
    ).long()
    ids = torch.randint(0, vocab, (int(sizes.sum()),), generator=g, dtype=torch.int32)
    starts = torch.cumsum(sizes, 0) - sizes
    ids[starts] = targets.to(torch.int32)  # duplicates are harmless: the keep mask is a set
    return ids, sizes.to(torch.int32)


def run_once(hidden, weight, targets, chunk, mask, temperature) -> tuple[float, float]:
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    ids, counts = mask if mask is not None else (None, None)
    with PeakRSS() as mem:
        start = time.perf_counter()
        lp, ent, _ = vocab_parallel_topk_stats(h, w, targets, None, temperature, chunk, True, None, ids, counts)
        (lp.sum() + 0.01 * ent.sum()).backward()
        wall = time.perf_counter() - start
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    return wall, mem.delta_mib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-support", type=int, default=10)
    ap.add_argument("--max-support", type=int, default=3000)
    ap.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0 = auto: 128 MiB fp32 buffers)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * 0.3
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    mask = supports(targets, args.vocab, args.min_support, args.max_support, args.seed + 1)
    chunk = args.chunk or auto_chunk_size(args.vocab)
    sizes = mask[1].float()
    print(
        f"vocab {args.vocab}, tokens {args.tokens}, hidden {args.hidden}, chunk {chunk} tokens, threads "
        f"{args.threads}; supports: median {sizes.median():.0f}, mean {sizes.mean():.0f}, max {sizes.max():.0f} ids "
        f"({mask[0].numel() * 4 / 2**20:.1f} MiB of int32 ids)"
    )
    run_once(hidden[:chunk], weight, targets[:chunk], chunk, None, 0.8)  # warm-up (allocator, threads)
    res: dict[str, list[tuple[float, float]]] = {"plain": [], "masked": []}
    for r in range(args.repeats):
        order = ("plain", "masked") if r % 2 == 0 else ("masked", "plain")
        for side in order:
            res[side].append(run_once(hidden, weight, targets, chunk, mask if side == "masked" else None, 0.8))
    print(f"{'':8} {'time s (median, min-max)':>28} {'peak RSS +MiB (median, min-max)':>34}")
    med = {}
    for side, rows in res.items():
        t, m = [x[0] for x in rows], [x[1] for x in rows]
        med[side] = (statistics.median(t), statistics.median(m))
        print(
            f"{side:8} {med[side][0]:10.2f} ({min(t):.2f}-{max(t):.2f}) {'':6} {med[side][1]:10.0f} "
            f"({min(m):.0f}-{max(m):.0f})"
        )
    print(
        f"masked / plain: time x{med['masked'][0] / med['plain'][0]:.2f}, peak memory "
        f"x{med['masked'][1] / max(med['plain'][1], 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
