"""Peak memory of chunked log-probs (`mcore_rl.train.logprobs`) vs materialising the full logits.

    .venv/bin/python benchmarks/bench_logprobs.py                       # 8192 tokens, vocab 150k, h 1024
    .venv/bin/python benchmarks/bench_logprobs.py --tokens 2048 --vocab 32000 --entropy

Both variants compute, in fp32 on one rank, the log-prob of a given token at every position from
hidden states [tokens, hidden] and an output weight [vocab, hidden] (optionally the entropy too),
then backward of their sum into both the hidden states and the weight:

* `full`    -- logits = hidden @ W.T ([tokens, vocab] fp32), log-probs via
  `F.cross_entropy(reduction="none")` (what a plain training loop does), entropy from
  `log_softmax`;
* `chunked` -- `vocab_parallel_token_stats`: per chunk of tokens (auto size: 128 MiB per
  [chunk, vocab] fp32 buffer), logits, softmax statistics and, in backward, recomputed logits and
  their gradient; only per-token scalars are kept between forward and backward.

Each variant runs alone in a subprocess. Reported: growth of the process's peak RSS (ru_maxrss)
during forward + backward, with the baseline taken after the inputs exist (hidden states and
weight, which both variants hold) and the high-water mark reset to the current RSS
(`/proc/self/clear_refs`). Both variants also allocate the weight gradient ([vocab, hidden] fp32,
vocab·hidden·4 bytes), which is part of the growth. The `full` variant is skipped (with the
reason) when MemAvailable is below its estimated need, instead of being OOM-killed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GIB = 2**30


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker(variant: str, tokens: int, vocab: int, hidden: int, entropy: bool, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from mcore_rl.train.logprobs import auto_chunk_size, vocab_parallel_token_stats

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    exact = _reset_peak()
    before = _maxrss_bytes()
    start = time.perf_counter()
    if variant == "full":
        logits = h @ w.t()
        lp = -F.cross_entropy(logits, y, reduction="none")
        loss = lp.sum()
        if entropy:
            logsm = logits.log_softmax(-1)
            loss = loss + (-(logsm.exp() * logsm).sum(-1)).sum()
            del logsm
        del logits
    else:
        lp, ent = vocab_parallel_token_stats(h, w, y, with_entropy=entropy)
        loss = lp.sum() + (ent.sum() if entropy else 0.0)
    value = float(lp.detach().sum())
    loss.backward()
    elapsed = time.perf_counter() - start
    return {
        "variant": variant,
        "peak_growth_bytes": _maxrss_bytes() - before,
        "exact_baseline": exact,
        "seconds": elapsed,
        "logp_sum": value,
        "grad_norm_w": float(w.grad.norm()),
        "chunk": min(auto_chunk_size(vocab), tokens) if variant == "chunked" else tokens,
    }


def _run(variant: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--threads",
        str(args.threads),
    ] + (["--entropy"] if args.entropy else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"variant": variant, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--entropy", action="store_true", help="also compute the entropy (and its gradient)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        print(json.dumps(worker(args.worker, args.tokens, args.vocab, args.hidden, args.entropy, args.threads)))
        return

    logits_bytes = args.tokens * args.vocab * 4
    weight_bytes = args.vocab * args.hidden * 4
    print(
        f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, fp32, forward+backward"
        f"{' with entropy' if args.entropy else ''}, {args.threads} threads"
    )
    print(
        f"one [tokens x vocab] fp32 tensor: {logits_bytes / GIB:.2f} GiB; weight gradient: {weight_bytes / GIB:.2f} GiB"
    )
    results = {"chunked": _run("chunked", args)}
    # measured: three [tokens x vocab] buffers at the peak (8192 x 150k: 13.2 GiB beyond the
    # weight gradient), two more with the entropy
    need = int(3.2 * logits_bytes) + weight_bytes + (2 * logits_bytes if args.entropy else 0)
    avail = _mem_available()
    if avail and avail < need * 1.1:
        results["full"] = {
            "variant": "full",
            "error": f"skipped: needs ~{need / GIB:.1f} GiB, {avail / GIB:.1f} GiB available",
        }
    else:
        results["full"] = _run("full", args)

    print(f"{'variant':<10} {'peak RSS growth':>16} {'seconds':>9} {'tokens/chunk':>13} {'sum of log-probs':>17}")
    for name in ("full", "chunked"):
        r = results[name]
        if "error" in r:
            print(f"{name:<10} {r['error']}")
            continue
        print(
            f"{name:<10} {r['peak_growth_bytes'] / GIB:>12.2f} GiB {r['seconds']:>9.1f} {r['chunk']:>13} {r['logp_sum']:>17.6e}"
        )
    if all("error" not in r for r in results.values()):
        full, chunked = results["full"], results["chunked"]
        ratio = full["peak_growth_bytes"] / max(chunked["peak_growth_bytes"], 1)
        extra_full = full["peak_growth_bytes"] - weight_bytes
        extra_chunked = chunked["peak_growth_bytes"] - weight_bytes
        print(
            f"ratio full / chunked: {ratio:.1f}x  (beyond the weight gradient: "
            f"{extra_full / GIB:.2f} GiB vs {extra_chunked / GIB:.2f} GiB)"
        )
        rel = abs(full["logp_sum"] - chunked["logp_sum"]) / abs(full["logp_sum"])
        print(
            f"same result: sum of log-probs rel. diff {rel:.1e}, "
            f"|grad W| {full['grad_norm_w']:.6e} vs {chunked['grad_norm_w']:.6e}"
        )


if __name__ == "__main__":
    main()
