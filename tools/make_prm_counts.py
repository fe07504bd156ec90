"""Monte-Carlo continuation counts for process-reward-model training, from a shipped task and a policy.

For each of `--num` problems of `--task` the policy (an HF checkpoint dir, or the built-in demo model
without `--model-path`) writes one solution; it is cut into steps at `--step-delimiter`. From each
step's prefix — the same ids `rm-train` reads, `[bos] prompt step₁ D … step_t D`
(`data/process_rewards.py: process_ids`) — the policy writes `--rollouts` N continuations, and the
task's reward (the registered function RL scores it with) scores the prefix's text followed by each: K of N succeeded. This is the labelling
of "Math-Shepherd" (arXiv:2312.08935) that BetaPRM trains on ("Process Rewards with Learned
Reliability": a Beta-Binomial likelihood of K given N per step). The output is the jsonl
`mcore-rl rm-train reward_model.objective=beta_prm data.path=...` reads:

    {"prompt": "12+30=", "steps": ["27"], "successes": [8], "rollouts": 8}

    python tools/make_prm_counts.py --model-path runs/demo/hf --task addition --num 200 --rollouts 8 --out prm.jsonl

A solution that is empty or has an empty step (two delimiters in a row) is skipped and counted: a
step must hold text (`data/process_rewards.py`). The shipped tasks answer in one line, so with the
default delimiter ("\\n") each solution is one step, whose count is the policy's pass rate from
the finished answer; a policy that writes several lines (reasoning-gym prompts, a chat model) gets
one count per line.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any

from mcore_rl.data.process_rewards import process_ids


def split_steps(text: str, delimiter: str) -> list[str] | None:
    """The solution's steps (a delimiter at the very end ends the last step); None when it is empty
    or has an empty step."""
    pieces = text.split(delimiter)
    if pieces and pieces[-1] == "":
        pieces = pieces[:-1]
    if not pieces or any(not p.strip() for p in pieces):
        return None
    return pieces


def _generate(
    engine: Any, rows: list[list[int]], n: int, temperature: float, max_new: int, seed: int
) -> list[list[list[int]]]:
    """`n` completions of each row (each its own seed), as ids without the end-of-text token."""
    from mcore_rl.rollout.engine import Request, SamplingParams

    eos = set(engine.eos_token_ids)
    for i, row in enumerate(rows):
        for j in range(n):
            sampling = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed + 1000 * i + j)
            engine.add_request(Request(f"{seed}-{i}-{j}", list(row), sampling))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                out[o.rid] = [t for t in o.output_ids if t not in eos]  # the text the verifier reads
    return [[out[f"{seed}-{i}-{j}"] for j in range(n)] for i in range(len(rows))]


def task_verifier(task: Any) -> Callable[[str, str], float]:
    """The task's registered reward as `verify(prompt, completion)`: what RL scores the completion
    with (stop markers cut as there), not the raw `task.score`."""
    from mcore_rl.rewards.base import RewardInput
    from mcore_rl.rewards.registry import get_reward_fn

    reward = get_reward_fn(task.reward)

    def verify(prompt: str, completion: str) -> float:
        value = reward(RewardInput(prompt, completion))
        if inspect.isawaitable(value):
            value = asyncio.run(value)
        return float(value["reward"] if isinstance(value, dict) else value)

    return verify


def prm_counts(
    engine: Any,
    tokenizer: Any,
    verify: Callable[[str, str], float],
    prompts: list[str],
    rollouts: int = 8,
    delimiter: str = "\n",
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], int]:
    """(the step-labelled solutions of `prompts`, how many problems were skipped); see the module
    docstring. All solutions are drawn in one batch, then every step prefix's continuations."""
    if rollouts < 1:
        raise ValueError(f"rollouts must be >= 1, got {rollouts}")
    starts = [process_ids(p, [], delimiter, tokenizer)[0] for p in prompts]
    solutions = [
        tokenizer.decode(g[0], skip_special_tokens=True)
        for g in _generate(engine, starts, 1, temperature, max_new_tokens, seed)
    ]
    labelled, prefixes = [], []
    for prompt, text in zip(prompts, solutions):
        steps = split_steps(text, delimiter)
        if steps is None:
            continue
        labelled.append((prompt, steps))
        prefixes += [(prompt, steps[: t + 1]) for t in range(len(steps))]
    rows = [process_ids(p, s, delimiter, tokenizer)[0] for p, s in prefixes]
    conts = _generate(engine, rows, rollouts, temperature, max_new_tokens, seed + 1)
    successes = [
        sum(
            verify(p, delimiter.join(s) + delimiter + tokenizer.decode(c, skip_special_tokens=True)) >= 1.0
            for c in group
        )
        for (p, s), group in zip(prefixes, conts)
    ]
    out, at = [], 0
    for prompt, steps in labelled:
        counts = successes[at : at + len(steps)]
        at += len(steps)
        out.append({"prompt": prompt, "steps": steps, "successes": [int(k) for k in counts], "rollouts": rollouts})
    return out, len(prompts) - len(labelled)


def main(argv: list[str] | None = None) -> None:
    from mcore_rl.data.tasks import get_task, task_names
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.engine import EngineCore

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="the policy, an HF checkpoint dir (default: the demo model)")
    ap.add_argument("--task", default="addition", choices=task_names())
    ap.add_argument("--max-digits", type=int, default=2, help="addition tasks: operand digits")
    ap.add_argument("--num", type=int, default=100, help="problems")
    ap.add_argument("--rollouts", type=int, default=8, help="N continuations per step prefix")
    ap.add_argument("--step-delimiter", default="\n", help="ends every step (data.step_delimiter)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="the problems' and the sampling's seed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    options = {"max_digits": args.max_digits} if args.task.startswith("addition") else {}
    task = get_task(args.task, **options)
    engine = EngineCore.from_model_path(
        args.model_path,
        max_running_requests=min(max(args.num * args.rollouts, 1), 256),
        context_length=1024,
        random_seed=0,
    )
    tokenizer = engine.tokenizer if args.model_path is None else load_tokenizer(args.model_path)
    prompts = [p for p, _ in task.examples(args.num, args.seed)]
    out, skipped = prm_counts(
        engine,
        tokenizer,
        task,
        prompts,
        args.rollouts,
        args.step_delimiter,
        args.temperature,
        args.max_new_tokens,
        args.seed,
    )
    with open(args.out, "w", encoding="utf-8") as f:
        for obj in out:
            f.write(json.dumps(obj) + "\n")
    steps = sum(len(o["steps"]) for o in out)
    print(
        f"wrote {len(out)} solutions ({steps} steps, {skipped} problems skipped: empty or an empty step) to {args.out}"
    )


if __name__ == "__main__":
    main()
