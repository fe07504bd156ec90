"""Train DSpark's confidence head from logged acceptance and measure its calibration.

    .venv/bin/python tools/train_confidence_head.py --kind standalone --out head.json          # demo model
    .venv/bin/python tools/train_confidence_head.py --model-path DIR/hf --kind ngram --out head.json

Runs the embedded engine with speculative decoding (fixed k, every draft verified) on two sets of
requests — training and held-out (other seeds, other prompt order) — and logs every reached draft
(verified with every earlier draft of its pass accepted): its features (`spec_confidence.FEATURES`),
whether it was accepted, and its acceptance probability sum_v min(p, q). The head is fitted to the
soft labels of the first 70% of the training rows, its per-position temperatures (STS) to those
of the remaining 30%, and its calibration is measured on the held-out rows: a reliability
table (mean predicted c against the observed acceptance rate per bin), the expected calibration
error, Brier score and log loss — beside the same for the schedule's default confidence, the
request's acceptance so far (shrunk to the engine's). `--out` writes the head for
`rollout.speculative_confidence_head` / `--speculative-confidence-head`.

Prompts quote a passage and ask for it again (as `benchmarks/bench_speculative.py`), so prompt lookup
finds something; `standalone` drafts with the target's first `--draft-layers` layers, plus Gaussian
noise of std `--draft-noise` on its weights (the demo model's layer-skip draft is accepted ~95% of
the time whatever the context; noise makes acceptance vary, which is what a head can predict).
"""

from __future__ import annotations

import argparse
import copy
import random

import torch

PASSAGES = [
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "The quick brown fox jumps over the lazy dog. The dog does not move.",
    "for i in range(10):\n    total += values[i] * weights[i]\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY age DESC;",
    "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987",
]


def prompts_for(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.choice(PASSAGES)
        cut = rng.randint(len(p) // 5, len(p) // 2)
        out.append(tokenizer.encode(f"Copy this text exactly.\n{p}\nCopy:\n{p[:cut]}"))
    return out


def noisy(model, scale: float) -> None:
    """Gaussian noise of std `scale` on every weight (seeded): a draft accepted often, not always."""
    if scale <= 0:
        return
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def collect(model, tokenizer, draft, args, seed: int) -> list[tuple[torch.Tensor, bool, float]]:
    """The spec_log rows of `args.requests` requests (seeds from `seed`), `args.batch` at a time."""
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings

    prompts = prompts_for(tokenizer, args.requests, seed)
    longest = max(len(p) for p in prompts)
    engine = EngineCore(
        model,
        tokenizer,
        max_running_requests=args.batch,
        context_length=longest + args.new_tokens + 1,
        max_total_tokens=args.batch * (longest + args.new_tokens + 16),
        speculative=SpeculativeSettings(args.kind.upper(), num_steps=args.num_steps),
        draft_model=copy.deepcopy(draft) if draft is not None else None,
    )
    engine.spec_log = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(
            max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True, seed=seed * 100_003 + i
        )
        engine.add_request(Request(str(i), p, sp))
    while engine.has_work():
        engine.step()
    return engine.spec_log


def report(name: str, cal) -> None:
    print(f"{name}: ECE {cal.ece:.3f}, Brier {cal.brier:.3f}, log loss {cal.log_loss:.3f}")
    print("| predicted c (bin mean) | observed acceptance | mean soft label | rows |")
    print("| ---: | ---: | ---: | ---: |")
    for mp, my, ms, k in cal.bins:
        print(f"| {mp:.2f} | {my:.2f} | {ms:.2f} | {k} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="HF directory of the target (default: the demo model)")
    ap.add_argument("--kind", default="standalone", choices=["ngram", "standalone"])
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-noise", type=float, default=0.0, help="standalone: add N(0, s^2) to the draft's weights")
    ap.add_argument("--num-steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64, help="requests per set (training, held-out)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="where to write the head (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.engine.spec_confidence import (
        FEATURES,
        calibration,
        fit,
        fit_temperatures,
        stack_log,
    )

    engine = EngineCore.from_model_path(args.model_path, max_total_tokens=1 << 14, random_seed=args.seed)
    model, tokenizer = engine.model, engine.tokenizer
    draft = None
    if args.kind == "standalone":
        draft = copy.deepcopy(model)
        draft.model.layers = draft.model.layers[: args.draft_layers]
        draft.config.num_hidden_layers = args.draft_layers
        noisy(draft, args.draft_noise)
    train = collect(model, tokenizer, draft, args, seed=1)
    held = collect(model, tokenizer, draft, args, seed=2)
    x, y, soft = stack_log(train)
    xt, yt, softt = stack_log(held)
    split = int(0.7 * len(x))
    head = fit(x[:split], soft[:split])
    head = fit_temperatures(head, x[split:], soft[split:], args.num_steps)
    print(
        f"target {args.model_path or 'demo'}, draft {args.kind}, k={args.num_steps}, temperature {args.temperature}: "
        f"{len(x)} training rows (acceptance {float(y.mean()):.3f}), {len(xt)} held-out rows "
        f"(acceptance {float(yt.mean()):.3f})"
    )
    print("weights:", ", ".join(f"{n} {w:+.3f}" for n, w in zip(FEATURES, head.weights)))
    print("STS temperatures per position:", ", ".join(f"{t:.2f}" for t in head.temperatures))
    report("trained head, held-out", calibration(head.predict_rows(xt), yt, softt))
    report("acceptance so far (the default), held-out", calibration(torch.sigmoid(xt[:, 2].double()), yt, softt))
    pos = xt[:, 1].exp().round().long()
    pred = head.predict_rows(xt)
    print("| position | rows | predicted (mean) | observed |")
    print("| ---: | ---: | ---: | ---: |")
    for i in range(1, args.num_steps + 1):
        rows = pos == i
        if bool(rows.any()):
            print(f"| {i} | {int(rows.sum())} | {float(pred[rows].mean()):.3f} | {float(yt[rows].mean()):.3f} |")
    if args.out:
        head.save(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
