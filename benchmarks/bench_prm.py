"""BetaPRM's best-of-N on a shipped task, against best-of-1 and majority voting, over seeds.

    python benchmarks/bench_prm.py --work runs/bench_prm [--seeds 1 2 3] [--policy-steps 150] [--prm-steps 100]

1. A policy: the demo-size decoder (2 layers, 64 wide) after `--policy-steps` SFT steps (`--policy-lr`,
   constant) on the task's reference answers (`mcore-rl sft`), exported to HF (`mcore-rl convert mcore-to-hf`).
2. PRM data: `tools/make_prm_counts.py` with that policy on `--prm-problems` training problems, N =
   `--rollouts` continuations per step prefix, steps cut at "\\n".
3. The PRM: the same decoder size with BetaPRM's head (`mcore-rl rm-train reward_model.objective=beta_prm`,
   `--prm-steps` steps), exported to HF.
4. Per seed, `--problems` held-out problems (another seed than the PRM's), 8 samples each at
   temperature 1; the rows printed, as accuracy over the problems:
     best-of-1      the mean accuracy of a single sample (all 8 averaged: pass@1)
     majority@8     the most frequent answer among the 8 (ties: the first drawn)
     prm best-of-8  the sample with the highest μ at its last step (the PRM's belief it succeeds)
     adaptive       BetaPRM's adaptive stopping (`adaptive_best_of_n`, batches of 2, z = 1, at most 8),
                    drawing from the same 8 samples in order; with the mean number drawn
     oracle pass@8  some sample right (the ceiling of any selection)

A response is scored as the reward head scores it (`step_beliefs`): the task's one-line answer has no
delimiter, and its step is read with one appended, where `rm-train` read it.
Stages 1-3 are cached in `--work`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

MODEL = [
    "model.arch=qwen3",
    "model.vocab_size=384",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.max_position_embeddings=256",
]
COMMON = ["train.seq_length=40", "train.micro_batch_size=16", "train.global_batch_size=16", "optimizer.lr=1e-3"]
COMMON += ["train.log_interval=100000"]
N = 8


def _cli(*args: str) -> None:
    print("$ mcore-rl " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "mcore_rl.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def policy(work: str, task: str, digits: int, steps: int, lr: float) -> str:
    hf = os.path.join(work, "policy_hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        ckpt = os.path.join(work, "policy_ckpt")
        _cli(
            "sft",
            *MODEL,
            *COMMON,
            f"run_dir={work}/policy",
            f"data.synthetic_task={task}",
            f"data.synthetic_max_digits={digits}",
            "data.synthetic_num_examples=4000",
            f"train.train_iters={steps}",
            f"optimizer.lr={lr}",
            "optimizer.lr_decay_style=constant",
            "train.eval_interval=0",
            f"checkpoint.save_dir={ckpt}",
        )
        _cli("convert", "mcore-to-hf", "--input", ckpt, "--output", hf)
    return hf


def engine_of(hf: str) -> object:
    from mcore_rl.rollout.engine import EngineCore

    return EngineCore.from_model_path(hf, max_running_requests=256, context_length=64, random_seed=0)


def counts(work: str, engine: object, task: object, problems: int, rollouts: int) -> str:
    import json

    from make_prm_counts import prm_counts, task_verifier

    path = os.path.join(work, "prm_counts.jsonl")
    if not os.path.exists(path):
        prompts = [p for p, _ in task.examples(problems, 0)]  # type: ignore[attr-defined]
        out, skipped = prm_counts(engine, engine.tokenizer, task_verifier(task), prompts, rollouts, "\n", 1.0, 8, 0)  # type: ignore[attr-defined]
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(o) + "\n" for o in out)
        rate = sum(o["successes"][-1] for o in out) / max(1, rollouts * len(out))
        print(f"PRM data: {len(out)} solutions, {skipped} skipped, mean K/N at the last step {rate:.3f}", flush=True)
    return path


def prm(work: str, data: str, steps: int) -> str:
    hf = os.path.join(work, "prm_hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        ckpt = os.path.join(work, "prm_ckpt")
        _cli(
            "rm-train",
            *MODEL,
            *COMMON,
            f"run_dir={work}/prm",
            f"data.path={data}",
            "reward_model.objective=beta_prm",
            "reward_model.num_heads=2",
            f"train.train_iters={steps}",
            f"train.eval_interval={steps}",
            "train.eval_iters=4",
            f"checkpoint.save_dir={ckpt}",
        )
        _cli("convert", "mcore-to-hf", "--input", ckpt, "--output", hf)
    return hf


def sample(engine: object, prompts: list[list[int]], seed: int) -> list[list[list[int]]]:
    from make_prm_counts import _generate

    return _generate(engine, prompts, N, 1.0, 8, seed)


def evaluate(engine: object, prm_dir: str, task: object, problems: int, seed: int) -> dict[str, float]:
    from mcore_rl.data.process_rewards import process_ids
    from mcore_rl.rewards.process_reward import adaptive_best_of_n, candidate_belief, load_prm, step_beliefs

    from make_prm_counts import task_verifier

    tok = engine.tokenizer  # type: ignore[attr-defined]
    verify = task_verifier(task)
    model = load_prm(prm_dir)
    newline = tok.encode("\n")
    examples = [p for p, _ in task.examples(problems, 100_000 + seed)]  # type: ignore[attr-defined]
    prompt_ids = [process_ids(p, [], "\n", tok)[0] for p in examples]
    groups = sample(engine, prompt_ids, 7919 * seed)

    async def beliefs(pids: list[int], group: list[list[int]]) -> list[tuple[float, float]]:
        got = await asyncio.gather(*(step_beliefs(model, pids, r, newline) for r in group))
        return [candidate_belief(b) for b in got]

    rows: dict[str, list[float]] = {k: [] for k in ("best-of-1", "majority@8", "prm best-of-8", "adaptive", "drawn")}
    rows["oracle pass@8"] = []
    for prompt, pids, group in zip(examples, prompt_ids, groups):
        texts = [tok.decode(r, skip_special_tokens=True).strip() for r in group]
        right = [verify(prompt, t) >= 1.0 for t in texts]
        scored = asyncio.run(beliefs(pids, group))
        rows["best-of-1"].append(sum(right) / N)
        top = Counter(texts).most_common(1)[0][1]
        rows["majority@8"].append(float(right[next(i for i, t in enumerate(texts) if texts.count(t) == top)]))
        rows["prm best-of-8"].append(float(right[max(range(N), key=lambda i: scored[i][0])]))
        drawn = iter(range(N))
        order: list[int] = []

        def draw(k: int) -> list[list[int]]:
            picked = [next(drawn) for _ in range(k)]
            order.extend(picked)
            return [group[i] for i in picked]

        def score(responses: list[list[int]]) -> list[tuple[float, float]]:
            return [scored[order[len(order) - len(responses) + j]] for j in range(len(responses))]

        best = adaptive_best_of_n(draw, score, batch_size=2, max_candidates=N, z=1.0)
        rows["adaptive"].append(float(right[order[best.best]]))
        rows["drawn"].append(float(len(best.candidates)))
        rows["oracle pass@8"].append(float(any(right)))
    return {k: statistics.fmean(v) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "bench_prm"))
    ap.add_argument("--task", default="addition_lsd")
    ap.add_argument("--max-digits", type=int, default=2)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--policy-steps", type=int, default=150)
    ap.add_argument("--policy-lr", type=float, default=3e-3, help="the SFT's (the demo's warm start: 3e-3, constant)")
    ap.add_argument("--prm-problems", type=int, default=400)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--prm-steps", type=int, default=100)
    ap.add_argument("--problems", type=int, default=100)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from mcore_rl.data.tasks import get_task

    os.makedirs(args.work, exist_ok=True)
    task = get_task(args.task, max_digits=args.max_digits)
    start = time.perf_counter()
    engine = engine_of(policy(args.work, args.task, args.max_digits, args.policy_steps, args.policy_lr))
    prm_dir = prm(args.work, counts(args.work, engine, task, args.prm_problems, args.rollouts), args.prm_steps)
    print(f"stages 1-3: {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        results.append(evaluate(engine, prm_dir, task, args.problems, seed))
        print(f"seed {seed}: {results[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n| selection | accuracy, seeds {', '.join(map(str, args.seeds))} | mean |")
    print("| --- | --- | --- |")
    for key in results[0]:
        values = [r[key] for r in results]
        shown = ", ".join(f"{v:.1%}" if key != "drawn" else f"{v:.2f}" for v in values)
        mean = statistics.fmean(values)
        print(f"| {key} | {shown} | {mean:.1%} |" if key != "drawn" else f"| {key} | {shown} | {mean:.2f} |")


if __name__ == "__main__":
    main()
