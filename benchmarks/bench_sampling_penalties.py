"""Decode cost of SGLang's logit processors (penalties and `logit_bias`) in the embedded engine.

The demo model, `--requests` requests of `--tokens` sampled tokens each, with and without
`frequency_penalty`, `presence_penalty`, `repetition_penalty` and a `logit_bias`; the two sides
alternate within each round so load from other processes hits both alike. Prints the median, min
and max wall time of the whole batch (prefill included) per side.

    PYTHONPATH=. python benchmarks/bench_sampling_penalties.py --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mcore_rl.rollout.engine.core import EngineCore, Request
from mcore_rl.rollout.engine.sampling import SamplingParams

PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, logit_bias={"80": 1.0})


def batch_seconds(core: EngineCore, requests: int, tokens: int, penalized: bool) -> float:
    extra = PENALTIES if penalized else {}
    for i in range(requests):
        sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True, seed=i, temperature=1.0, **extra)
        core.add_request(Request(f"r{i}", core.tokenizer.encode(f"prompt {i}"), sp))
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    core = EngineCore.from_model_path(None, context_length=512, max_running_requests=args.requests, random_seed=0)
    batch_seconds(core, args.requests, args.tokens, False)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for penalized in (False, True) if r % 2 == 0 else (True, False):
            times[penalized].append(batch_seconds(core, args.requests, args.tokens, penalized))
    for penalized, t in times.items():
        print(
            f"{'penalties + logit_bias' if penalized else 'plain':>22}: median {statistics.median(t):.3f} s "
            f"(min {min(t):.3f}, max {max(t):.3f}, {len(t)} rounds)"
        )


if __name__ == "__main__":
    main()
