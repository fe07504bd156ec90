"""Screen reasoning-gym tasks for a real model: its accuracy on each before any RL.

An RL recipe needs tasks where the base model is neither at 0% (no reward signal) nor near 100%
(nothing to learn). This loads an HF checkpoint into the embedded engine, renders each task's
questions with the model's chat template (and an optional system prompt), decodes greedily and/or
samples k completions, and scores them with the training reward (reasoning-gym's own scorer, on
the `<answer>` tag if present). Prints one row per task: greedy accuracy, avg@k, mean response
tokens, the share cut by the token budget, and generation tokens/s.

    .venv/bin/python tools/screen_tasks.py --model-path runs/smollm2/hf \
        --tasks chain_sum leg_counting spell_backward --num 64 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def generate(engine, prompts: list[list[int]], n: int, temperature: float, max_new: int, seed: int, bar=None):
    """All prompts x n through the engine at once; returns (outputs per prompt, seconds, tokens).
    `bar` (a `mcore_rl.progress` bar) advances by one per finished completion."""
    from mcore_rl.rollout.engine import Request, SamplingParams

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for j in range(n):
            sp = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed + 1000 * i + j)
            engine.add_request(Request(f"{i}-{j}", list(p), sp))
    outs: dict[str, object] = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                outs[o.rid] = o
                if bar is not None:
                    bar.update(1)
    dt = time.perf_counter() - t0
    grouped = [[outs[f"{i}-{j}"] for j in range(n)] for i in range(len(prompts))]
    return grouped, dt, sum(len(o.output_ids) for g in grouped for o in g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="an HF checkpoint dir (config.json, safetensors, tokenizer)")
    ap.add_argument("--tasks", nargs="+", required=True, help="reasoning-gym dataset names")
    ap.add_argument("--options", default="{}", help='JSON: per-task options, {"chain_sum": {"max_terms": 2}}')
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--num", type=int, default=64, help="questions per task")
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--k", type=int, default=0, help="sampled completions per question (0 = greedy only)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--fp8", action="store_true", help="FP8 block-quantised weights (the engine's quantization)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--extract", default="auto", help="the reward's answer extraction: auto | tag | last_number")
    ap.add_argument("--show", type=int, default=0, help="print this many completions per task")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from mcore_rl.data.tasks.reasoning_gym import ReasoningGymTask, reasoning_gym_reward
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rewards import RewardInput
    from mcore_rl.rollout.engine import EngineCore

    tok = load_tokenizer(args.model_path)
    engine = EngineCore.from_model_path(
        args.model_path,
        quantization="fp8" if args.fp8 else None,
        dtype=args.dtype,
        max_running_requests=max(args.num * max(args.k, 1), 1),
        context_length=1024,
    )
    options = json.loads(args.options)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    print(f"{'task':24s} {'greedy':>7s} {'avg@k':>7s} {'resp tok':>8s} {'cut':>5s} {'tok/s':>7s}")
    for name in args.tasks:
        task = ReasoningGymTask(name, **options.get(name, {}))
        examples = task.rl_examples(args.num, args.seed)
        ids = [
            tok.apply_chat_template(
                system + [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            for q, _ in examples
        ]
        ids = [tok.encode(t) for t in ids]
        row, lengths, cut, tps = {}, [], [], []
        for label, n, temp in (("greedy", 1, 0.0), ("avg@k", args.k, args.temperature)):
            if n == 0:
                row[label] = float("nan")
                continue
            groups, dt, ntok = generate(engine, ids, n, temp, args.max_new_tokens, args.seed)
            tps.append(ntok / dt)
            scores = []
            for (q, entry), g in zip(examples, groups):
                for o in g:
                    text = tok.decode(o.output_ids)
                    scores.append(reasoning_gym_reward(RewardInput(q, text, entry), extract=args.extract))
                    lengths.append(len(o.output_ids))
                    cut.append(o.finish_reason.get("type") == "length" if isinstance(o.finish_reason, dict) else False)
            row[label] = sum(s >= 1.0 for s in scores) / len(scores)
            if label == "greedy" and args.show:
                for (q, entry), g in list(zip(examples, groups))[: args.show]:
                    print(f"  Q: {q[:200]!r}\n  A: {tok.decode(g[0].output_ids)[:300]!r}  (answer {entry['answer']!r})")
        print(
            f"{name:24s} {row['greedy']:7.1%} {row['avg@k']:7.1%} {sum(lengths) / len(lengths):8.1f} "
            f"{sum(cut) / len(cut):5.0%} {sum(tps) / len(tps):7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
