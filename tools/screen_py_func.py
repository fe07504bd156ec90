"""Screen the py_func code task for a real model: its pass rate per template before any RL.

Every problem of the chosen templates (or `--num` of them) is rendered with the model's chat
template, decoded greedily (and `--k` samples at `--temperature`), and scored by the training
reward (the program in the sandbox, the hidden tests in the checker, all-or-nothing). Prints one
row per template and the total; `--out` writes the per-problem results as JSON lines.

    python tools/screen_py_func.py --model-path runs/smollm2/hf --max-new-tokens 160 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from screen_tasks import generate  # (the same engine loop as the reasoning-gym screen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="an HF checkpoint dir (config.json, safetensors, tokenizer)")
    ap.add_argument("--templates", nargs="*", default=[], help="template keys (default: all)")
    ap.add_argument("--num", type=int, default=0, help="problems drawn (0 = every problem once)")
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--k", type=int, default=0, help="sampled completions per problem (0 = greedy only)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--workers", type=int, default=4, help="sandboxed scorings at once")
    ap.add_argument("--out", default=None, help="per-problem results (JSON lines)")
    args = ap.parse_args()

    from concurrent.futures import ThreadPoolExecutor

    from mcore_rl.data.tasks.py_func import PyFuncTask, py_func_reward
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rewards import RewardInput
    from mcore_rl.rollout.engine import EngineCore

    task = PyFuncTask(templates=tuple(args.templates))
    key_of = {}
    from mcore_rl.data.tasks.py_func import TEMPLATES, all_problems

    for t in TEMPLATES:
        for p in all_problems((t.key,)):
            key_of[p.prompt] = t.key
    n = args.num or len(task.problems())
    examples = task.rl_examples(n, args.seed)
    tok = load_tokenizer(args.model_path)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    texts = [
        tok.apply_chat_template(system + [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q, _ in examples
    ]
    ids = [tok.encode(t) for t in texts]
    engine = EngineCore.from_model_path(
        args.model_path, dtype=args.dtype, max_running_requests=min(64, len(ids) * max(args.k, 1)), context_length=1024
    )
    rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    records = []
    with ThreadPoolExecutor(args.workers) as pool:
        for mode, k, temp in (("greedy", 1, 0.0), ("sampled", args.k, args.temperature)):
            if k == 0:
                continue
            groups, dt, ntok = generate(engine, ids, k, temp, args.max_new_tokens, args.seed)
            print(f"{mode}: {ntok} tokens in {dt:.0f} s ({ntok / dt:.1f} tok/s)", flush=True)
            jobs = []
            for (q, label), g in zip(examples, groups):
                for o in g:
                    text = tok.decode(o.output_ids)
                    cut = isinstance(o.finish_reason, dict) and o.finish_reason.get("type") == "length"
                    fut = pool.submit(py_func_reward, RewardInput(q, text, label))
                    jobs.append((q, text, len(o.output_ids), cut, fut))
            for q, text, length, cut, fut in jobs:
                res = fut.result()
                key = key_of[q]
                rows[key][mode].append(res["reward"])
                rows[key][mode + "_len"].append(length)
                rows[key][mode + "_cut"].append(cut)
                records.append({"mode": mode, "template": key, "prompt": q, "completion": text, **res})
    print(f"{'template':16s} {'n':>3s} {'greedy':>7s} {'avg@k':>7s} {'tok':>5s} {'cut':>5s}")
    total: dict[str, list] = defaultdict(list)
    for key in sorted(rows):
        r = rows[key]
        for m in ("greedy", "sampled", "greedy_len", "greedy_cut"):
            total[m] += r[m]
        avg = f"{sum(r['sampled']) / len(r['sampled']):7.1%}" if r["sampled"] else f"{'-':>7s}"
        print(
            f"{key:16s} {len(r['greedy']):3d} {sum(r['greedy']) / len(r['greedy']):7.1%} {avg} "
            f"{sum(r['greedy_len']) / len(r['greedy_len']):5.0f} {sum(r['greedy_cut']) / len(r['greedy_cut']):5.0%}"
        )
    avg = f"{sum(total['sampled']) / len(total['sampled']):7.1%}" if total["sampled"] else f"{'-':>7s}"
    print(
        f"{'all':16s} {len(total['greedy']):3d} {sum(total['greedy']) / len(total['greedy']):7.1%} {avg} "
        f"{sum(total['greedy_len']) / len(total['greedy_len']):5.0f} "
        f"{sum(total['greedy_cut']) / len(total['greedy_cut']):5.0%}"
    )
    if args.out:
        with open(args.out, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
