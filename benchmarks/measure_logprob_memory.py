"""Peak memory and time of the learner's log-probs + entropy on a long multi-turn sequence, with and
without the restriction to trained tokens (`token_mask`, `train/logprobs.py`).

The sequence is one episode packed as the learner sees it: a prompt, then `--turns` model turns of
`--turn-tokens` each, every one followed by an observation of `--obs-tokens` (tool output, the
template's headers); only the model's turns are trained. The output layer is SmolLM2-135M's shape
(hidden 576, a 49,152-token vocabulary). Each measurement runs in a fresh process (forward and
backward of `vocab_parallel_topk_stats` with the entropy, default chunk size): peak memory is the
process's peak RSS above its RSS once the inputs exist (on CUDA, `max_memory_allocated` above the
inputs); the variants alternate, `--repeats` times each, and the median and the range are printed.

    python benchmarks/measure_logprob_memory.py                     # CPU, the defaults
    python benchmarks/measure_logprob_memory.py --device cuda --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_once(args: argparse.Namespace, restricted: bool) -> dict[str, float]:
    """One forward + backward in this process; its peak memory above the inputs and its time."""
    import torch

    from mcore_rl.train.logprobs import vocab_parallel_topk_stats

    torch.manual_seed(0)
    dev = torch.device(args.device)
    n = args.prompt_tokens + args.turns * (args.turn_tokens + args.obs_tokens)
    keep = torch.zeros(n, dtype=torch.bool)
    pos = args.prompt_tokens
    for _ in range(args.turns):
        keep[pos : pos + args.turn_tokens] = True
        pos += args.turn_tokens + args.obs_tokens
    hidden = (0.02 * torch.randn(n, args.hidden, device=dev)).requires_grad_()
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device=dev)).requires_grad_()
    targets = torch.randint(0, args.vocab, (n,), device=dev)
    coef = torch.randn(2, n, device=dev)
    keep = keep.to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    start = time.perf_counter()
    logp, ent, _ = vocab_parallel_topk_stats(hidden, weight, targets, None, token_mask=keep if restricted else None)
    (keep * (coef[0] * logp + coef[1] * ent)).sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _peak_rss_bytes()
    return {
        "seconds": time.perf_counter() - start,
        "peak_mib": (peak - base) / 2**20,
        "tokens": n,
        "trained_tokens": int(keep.sum()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=256)
    p.add_argument("--obs-tokens", type=int, default=768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", choices=["full", "trained"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # one measurement, in a fresh process
        print(json.dumps(measure_once(args, args.child == "trained")))
        return
    results: dict[str, list[dict[str, float]]] = {"full": [], "trained": []}
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--child")]
    for _ in range(args.repeats):
        for variant in ("full", "trained"):  # alternate: a loaded machine drifts
            out = subprocess.run(
                [sys.executable, __file__, *passthrough, "--child", variant],
                check=True,
                capture_output=True,
                text=True,
            )
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = results["full"][0]
    print(
        f"{first['tokens']} tokens, {first['trained_tokens']} trained; hidden {args.hidden}, vocab {args.vocab}, "
        f"device {args.device}, {args.repeats} runs each (median [min, max])"
    )
    for variant, runs in results.items():
        mib = [r["peak_mib"] for r in runs]
        sec = [r["seconds"] for r in runs]
        print(
            f"{variant:8s} peak {statistics.median(mib):8.1f} MiB [{min(mib):.1f}, {max(mib):.1f}]   "
            f"time {statistics.median(sec):6.2f} s [{min(sec):.2f}, {max(sec):.2f}]"
        )


if __name__ == "__main__":
    main()
