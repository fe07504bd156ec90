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
     continue       BetaPRM's adaptive compute with continuation (`uncertain_prefix_best_of_n`, batches
                    of 2, z = 1, at most 8): the first batch from the prompt, each later one continues
                    the step prefix with the largest σ_t; new samples from the engine (seeded per
                    round and row, every problem's search in lockstep; its first batch is the first 2 of the 8, as `adaptive`'s);
                    with the mean number drawn and the tokens generated (both adaptive rows)
     oracle pass@8  some sample right (the ceiling of any selection)

A response is scored as the reward head scores it (`step_beliefs`): the task's one-line answer has no
delimiter, and its step is read with one appended, where `rm-train` read it.
Stages 1-3 are cached in `--work`.

`--stepped`: the answer is written one digit per step, each followed by the delimiter ";" ("07+35="
-> "2;4;0;"), so a solution has `max_digits + 1` steps and continuation has prefixes to continue
from (with "\\n" and the task's one-line answers every solution is one step: continuation is then
drawing from the prompt). The policy is trained on that format (`data.path`, a jsonl the bench
writes) and the verifier reads the answer with the delimiters removed.
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
from collections.abc import Callable

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


def stepped(answer: str, delimiter: str) -> str:
    """The answer one digit per step: "240" -> "2;4;0;" ("|" would read as YAML in an override)."""
    return "".join(d + delimiter for d in answer)


def policy(work: str, task: object, steps: int, lr: float, delimiter: str | None) -> str:
    hf = os.path.join(work, "policy_hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        ckpt = os.path.join(work, "policy_ckpt")
        if delimiter is None:
            data = [f"data.synthetic_task={task.name}", f"data.synthetic_max_digits={task.max_digits}"]  # type: ignore[attr-defined]
            data.append("data.synthetic_num_examples=4000")
        else:
            import json

            path = os.path.join(work, "sft.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for prompt, answer in task.examples(4000, 12345):  # type: ignore[attr-defined]
                    f.write(json.dumps({"prompt": prompt, "response": stepped(answer, delimiter)}) + "\n")
            data = [f"data.path={path}"]
        _cli(
            "sft",
            *MODEL,
            *COMMON,
            f"run_dir={work}/policy",
            *data,
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


def verifier(task: object, delimiter: str | None) -> Callable[[str, str], float]:
    """The task's reward as RL scores it; with `--stepped`, of the answer without its delimiters."""
    from make_prm_counts import task_verifier

    verify = task_verifier(task)
    if delimiter is None:
        return verify
    return lambda prompt, completion: verify(prompt, completion.split("\n", 1)[0].replace(delimiter, ""))


def counts(work: str, engine: object, task: object, problems: int, rollouts: int, delimiter: str | None) -> str:
    import json

    from make_prm_counts import prm_counts

    path = os.path.join(work, "prm_counts.jsonl")
    if not os.path.exists(path):
        prompts = [p for p, _ in task.examples(problems, 0)]  # type: ignore[attr-defined]
        verify, d = verifier(task, delimiter), delimiter or "\n"
        out, skipped = prm_counts(engine, engine.tokenizer, verify, prompts, rollouts, d, 1.0, 12, 0)  # type: ignore[attr-defined]
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(o) + "\n" for o in out)
        rate = sum(o["successes"][-1] for o in out) / max(1, rollouts * len(out))
        print(f"PRM data: {len(out)} solutions, {skipped} skipped, mean K/N at the last step {rate:.3f}", flush=True)
    return path


def prm(work: str, data: str, steps: int, delimiter: str | None) -> str:
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
            *([f"data.step_delimiter={delimiter}"] if delimiter else []),
            f"train.train_iters={steps}",
            f"train.eval_interval={steps}",
            "train.eval_iters=4",
            f"checkpoint.save_dir={ckpt}",
        )
        _cli("convert", "mcore-to-hf", "--input", ckpt, "--output", hf)
    return hf


MAX_NEW = 12


def sample(engine: object, prompts: list[list[int]], seed: int) -> list[list[list[int]]]:
    from make_prm_counts import _generate

    return _generate(engine, prompts, N, 1.0, MAX_NEW, seed)


def _generate_rows(engine: object, rows: list[list[int]], k: int, seed: int) -> list[list[list[int]]]:
    """k samples after each row (prompt + prefix), each its own seed, without the end-of-text token."""
    from make_prm_counts import _generate

    return _generate(engine, rows, k, 1.0, MAX_NEW, seed)


def evaluate(
    engine: object, prm_dir: str, task: object, problems: int, seed: int, delimiter: str | None
) -> dict[str, float]:
    from mcore_rl.data.process_rewards import process_ids
    from mcore_rl.rewards.process_reward import (
        StepBeliefs,
        UncertainPrefixSearch,
        adaptive_best_of_n,
        candidate_belief,
        load_prm,
        step_beliefs,
    )
    from mcore_rl.rewards.reward_model import Refused

    import torch

    tok = engine.tokenizer  # type: ignore[attr-defined]
    verify = verifier(task, delimiter)
    model = load_prm(prm_dir)
    delim = tok.encode(delimiter or "\n")
    examples = [p for p, _ in task.examples(problems, 100_000 + seed)]  # type: ignore[attr-defined]
    prompt_ids = [process_ids(p, [], delimiter or "\n", tok)[0] for p in examples]
    groups = sample(engine, prompt_ids, 7919 * seed)

    def text(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True).split("\n", 1)[0].replace(delimiter or "\n", "").strip()

    async def step_beliefs_of(pids: list[int], group: list[list[int]]) -> list[StepBeliefs]:
        async def one(r: list[int]) -> StepBeliefs:
            try:
                return await step_beliefs(model, pids, r, delim)
            except Refused:  # an empty response: no step
                return StepBeliefs(torch.zeros(0), torch.zeros(0))

        return list(await asyncio.gather(*(one(r) for r in group)))

    async def beliefs(pids: list[int], group: list[list[int]]) -> list[tuple[float, float]]:
        got = await step_beliefs_of(pids, group)
        return [candidate_belief(b) if b.mean.numel() else (0.0, 0.0) for b in got]  # no step: the worst

    names = ("best-of-1", "majority@8", "prm best-of-8", "adaptive", "drawn", "continue", "continue drawn")
    rows: dict[str, list[float]] = {k: [] for k in names}
    rows["adaptive tokens"], rows["continue tokens"], rows["oracle pass@8"] = [], [], []

    async def every_group() -> list[list[tuple[float, float]]]:
        return list(await asyncio.gather(*(beliefs(pids, group) for pids, group in zip(prompt_ids, groups))))

    for prompt, group, scored in zip(examples, groups, asyncio.run(every_group())):
        texts = [text(r) for r in group]
        right = [verify(prompt, t) >= 1.0 for t in texts]
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
        rows["adaptive tokens"].append(float(sum(len(group[i]) for i in order)))
        rows["oracle pass@8"].append(float(any(right)))
    # continuation, every problem's search in lockstep: one engine batch and one PRM batch per round;
    # the first round takes the group's first samples (as `adaptive` draws them)
    searches = [UncertainPrefixSearch(delim, None, batch_size=2, max_candidates=N, z=1.0) for _ in examples]
    generated = [0] * len(examples)
    round_no = 0
    while active := [(i, r) for i, r in enumerate(s.request() for s in searches) if r is not None]:
        if round_no == 0:
            new = {i: groups[i][:k] for i, (_, k) in active}
        else:
            rows_in = [prompt_ids[i] + prefix for i, (prefix, _) in active]
            drawn_all = _generate_rows(
                engine, rows_in, max(k for _, (_, k) in active), 7919 * seed + 1_000_003 * round_no
            )
            new = {i: got[:k] for (i, (_, k)), got in zip(active, drawn_all)}
        to_score = {i: searches[i].add(new[i]) for i, _ in active}
        for i, _ in active:
            generated[i] += sum(len(r) for r in new[i])

        async def all_beliefs() -> list[list[StepBeliefs]]:
            return list(await asyncio.gather(*(step_beliefs_of(prompt_ids[i], to_score[i]) for i, _ in active)))

        for (i, _), got in zip(active, asyncio.run(all_beliefs())):
            searches[i].scored(got)
        round_no += 1
    for i, (prompt, search) in enumerate(zip(examples, searches)):
        res = search.result()
        rows["continue"].append(
            float(verify(prompt, tok.decode(res.candidates[res.best], skip_special_tokens=True)) >= 1.0)
        )
        rows["continue drawn"].append(float(len(res.candidates)))
        rows["continue tokens"].append(float(generated[i]))
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
    ap.add_argument("--stepped", action="store_true", help='one digit per step, each ended by ";"')
    args = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from mcore_rl.data.tasks import get_task

    os.makedirs(args.work, exist_ok=True)
    task = get_task(args.task, max_digits=args.max_digits)
    start = time.perf_counter()
    delimiter = ";" if args.stepped else None
    engine = engine_of(policy(args.work, task, args.policy_steps, args.policy_lr, delimiter))
    data = counts(args.work, engine, task, args.prm_problems, args.rollouts, delimiter)
    prm_dir = prm(args.work, data, args.prm_steps, delimiter)
    print(f"stages 1-3: {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        results.append(evaluate(engine, prm_dir, task, args.problems, seed, delimiter))
        print(f"seed {seed}: {results[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n| selection | accuracy, seeds {', '.join(map(str, args.seeds))} | mean |")
    print("| --- | --- | --- |")
    for key in results[0]:
        values = [r[key] for r in results]
        count = "drawn" in key or "tokens" in key
        shown = ", ".join(f"{v:.2f}" if count else f"{v:.1%}" for v in values)
        mean = statistics.fmean(values)
        print(f"| {key} | {shown} | {mean:.2f} |" if count else f"| {key} | {shown} | {mean:.1%} |")


if __name__ == "__main__":
    main()
