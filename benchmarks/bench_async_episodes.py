"""Episodes per second, synchronous vs asynchronous `mcore-rl train`, on a long-tailed multi-turn task,
next to the same comparison on bench_async.py's single-turn workload, in the same rounds.

Why: in the synchronous schedule a step waits for its slowest group, and an episode's turns come one
after another, so a group with an 8-turn episode holds the step for 8 generate-observe round trips;
the asynchronous schedule keeps the engine busy with the next prompts meanwhile. The claim to test:
where turns vary in length the asynchronous gain exceeds the single-turn one.

    python benchmarks/bench_async_episodes.py                       # 3 rounds of 4 runs
    python benchmarks/bench_async_episodes.py --rounds 1 --steps 4  # a quick look

Workloads, the same generated-token budget per prompt:

* multi-turn: the benchmark's own environment `long_tail_turns` (registered here, in the trainer's
  process: the child runs `mcore_rl.cli.main` after importing this file). A prompt's episode lasts a
  fixed number of turns drawn from its seed — 1 turn for three prompts in four, 8 turns for the rest
  — of at most `--short` tokens each; the environment answers "go on" (a few template tokens) and
  scores the share of digits the model wrote, so there is something to learn.
* single-turn: bench_async.py's prompt file, 16-token answers for three prompts in four, 8x for the
  rest, scored by the same digit share (`tests.reward_fns:digit_count`).

Both run on the real engine path: the trainer starts one `mcore-rl serve` engine process on loopback
(pinned to the last core, the trainer to the others; `rollout.engine_processes=true`, the HTTP pool),
the demo-sized model, `--minibatches` optimizer steps per rollout step. The four runs are alternated
in every round so that load from other processes hits them alike; an episode is one group member (a
single-turn sample counts as an episode of one turn). Printed: episodes per second of the training
loop (setup excluded) per run, the median [min-max] per mode and the async/sync ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.samples import Prompt
from mcore_rl.envs import register_env
from mcore_rl.envs.base import AgentAction, Environment, EnvReset, EnvStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = {
    "sync": ["rollout.runtime=sync"],
    "async s=1": ["rollout.runtime=async", "rollout.max_staleness=1"],
}


@dataclass(frozen=True)
class LongTailOptions:
    short_turns: int = 1
    long_turns: int = 8
    long_frac: float = 0.25


@dataclass(frozen=True)
class LongTailPrompts:
    options: LongTailOptions

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        rng, o = random.Random(seed), self.options
        out: list[tuple[str, Any]] = []
        for i in range(n):
            turns = o.long_turns if rng.random() < o.long_frac else o.short_turns
            out.append((f"write digits #{seed % 9973}-{i}", {"turns": turns}))
        return out


@register_env("long_tail_turns", options=LongTailOptions, prompts=LongTailPrompts, origin="bench_async_episodes.py")
class LongTailTurns(Environment):
    """An episode of a fixed number of turns (the label's); each turn scores its share of digits."""

    def __init__(self, options: LongTailOptions) -> None:
        self.turns, self.done_turns = options.short_turns, 0

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        self.turns = int(prompt.label["turns"]) if isinstance(prompt.label, dict) else 1
        self.done_turns = 0
        return EnvReset(messages=[{"role": "user", "content": prompt.text}], state="0")

    def step(self, action: AgentAction) -> EnvStep:
        self.done_turns += 1
        text = action.text
        share = sum(c.isdigit() for c in text) / max(1, len(text))
        done = self.done_turns >= self.turns
        return EnvStep([{"role": "user", "content": "go on"}], share / self.turns, done, str(self.done_turns))


def common(args: argparse.Namespace, run_dir: str) -> list[str]:
    engine_core = sorted(os.sched_getaffinity(0))[-1]
    return [
        f"run_dir={run_dir}",
        f"train.num_steps={args.steps}",
        f"rollout.group_size={args.group_size}",
        f"rollout.prompts_per_step={args.prompts}",
        "rollout.quantization=none",
        "rollout.engine_processes=true",
        f"rollout.engine_cores=[[{engine_core}]]",
        "rollout.engine_threads=1",
        "rollout.context_length=512",
        "model.max_position_embeddings=512",
        f"algorithm.num_minibatches={args.minibatches}",
        "optimizer.lr=3e-4",
        "eval.interval=0",
        "eval.at_start=false",
        "eval.num_prompts=8",
        "eval.k=0",
        "reward.max_concurrency=1",
        f"train.seed={args.seed}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]


def multi_turn_recipe(args: argparse.Namespace, work: str) -> str:
    """The multi-turn workload as a recipe file (a list of domains is not an override)."""
    per_turn = args.short + 32  # the turn, the "go on" and the chat template's headers (~26 tokens)
    budget = args.long_turns * per_turn
    path = os.path.join(work, "multi_turn.yaml")
    with open(path, "w") as f:
        json.dump(
            {
                "train": {"seq_length": budget + 64, "micro_batch_size": 4},
                "rollout": {"max_new_tokens": budget},
                "reward": {"name": "addition"},
                "data": {
                    "domains": [
                        {
                            "name": "turns",
                            "environment": {
                                "name": "long_tail_turns",
                                "options": {"long_turns": args.long_turns, "long_frac": args.long_frac},
                                "max_turns": args.long_turns,
                                "max_tokens_per_turn": args.short,
                                "max_invalid_calls": args.long_turns + 1,
                            },
                            "max_new_tokens": budget,
                        }
                    ]
                },
            },
            f,
        )
    return path


def single_turn_overrides(args: argparse.Namespace, data: str) -> list[str]:
    return [
        f"data.path={data}",
        f"eval.path={data}",
        "reward.name=tests.reward_fns:digit_count",
        "train.seq_length=256",
        "train.micro_batch_size=4",
        f"rollout.max_new_tokens={args.short * args.long_turns}",
        "algorithm.mismatch.name=tis",
    ]


def run_once(args: argparse.Namespace, workload: str, schedule: str, run_dir: str, work: str) -> dict[str, float]:
    cores = sorted(os.sched_getaffinity(0))
    trainer_cores = set(cores[:-1]) or set(cores)
    if workload == "multi-turn":
        train = ["train", multi_turn_recipe(args, work), *common(args, run_dir), *SCHEDULES[schedule]]
    else:
        extra = single_turn_overrides(args, os.path.join(work, "prompts.jsonl"))
        train = ["train", *common(args, run_dir), *extra, *SCHEDULES[schedule]]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(train)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(len(trainer_cores)))
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, trainer_cores),
    )
    if proc.returncode != 0:
        raise SystemExit(f"{workload} {schedule} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r for r in (json.loads(x) for x in f) if "time/step_s" in r]
    with open(os.path.join(run_dir, "accounting.json")) as f:
        accounting = json.load(f)
    assert accounting["balanced"], accounting
    loop = steps[-1]["time/elapsed_s"] - (steps[0]["time/elapsed_s"] - steps[0]["time/step_s"])
    episodes = args.steps * args.prompts * args.group_size  # the trained groups' members
    return {
        "loop_s": loop,
        "episodes_per_s": episodes / loop,
        "process_s": time.perf_counter() - start,
        "turns": statistics.mean(r.get("episode/turns_mean", 1.0) for r in steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--short", type=int, default=16, help="tokens of a turn (single-turn: of a short answer)")
    p.add_argument("--long-turns", type=int, default=8, help="turns of a long episode (single-turn: the length factor)")
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--minibatches", type=int, default=3, help="optimizer steps per rollout step (training cost)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workloads", default="multi-turn,single-turn")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # the trainer, with `long_tail_turns` registered in its process
        from mcore_rl.cli import main as cli_main  # lazy: megatron-core, only the child trains

        raise SystemExit(cli_main(json.loads(args.child)))

    work = tempfile.mkdtemp(prefix="bench_async_episodes_")
    spec = importlib.util.spec_from_file_location("bench_async", os.path.join(ROOT, "benchmarks", "bench_async.py"))
    assert spec is not None and spec.loader is not None
    bench_async = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_async)  # its single-turn prompt file, the same workload as there
    bench_async.write_prompts(
        os.path.join(work, "prompts.jsonl"), 2000, args.short, args.long_turns, args.long_frac, args.seed
    )
    workloads = args.workloads.split(",")
    runs = [(w, s) for w in workloads for s in SCHEDULES]
    results: dict[tuple[str, str], list[dict[str, float]]] = {r: [] for r in runs}
    load: list[float] = []
    for k in range(args.rounds):
        for workload, schedule in runs:
            load.append(os.getloadavg()[0])
            name = f"{workload}_{schedule}_{k}".replace(" ", "_").replace("=", "")
            out = run_once(args, workload, schedule, os.path.join(work, name), work)
            results[(workload, schedule)].append(out)
            print(
                f"round {k + 1}/{args.rounds} {workload:>11} {schedule:>9}: {out['episodes_per_s']:6.2f} episodes/s "
                f"(loop {out['loop_s']:6.1f} s, {out['turns']:.2f} turns/episode, load {load[-1]:.1f})",
                flush=True,
            )

    print(
        f"\n{args.steps} steps of {args.prompts} prompts x {args.group_size} episodes; {args.long_frac:.0%} of prompts "
        f"long ({args.long_turns} turns or {args.long_turns}x tokens of {args.short}); {args.rounds} rounds, "
        f"median [min-max]; 1-min load average {min(load):.1f}-{max(load):.1f}"
    )
    for workload in workloads:
        rates = {s: [r["episodes_per_s"] for r in results[(workload, s)]] for s in SCHEDULES}
        ratios = [a / s for a, s in zip(rates["async s=1"], rates["sync"])]  # same round, paired
        cells = "  ".join(f"{s} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for s, v in rates.items())
        print(
            f"{workload:>11}: episodes/s {cells}  async/sync {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}-{max(ratios):.2f}] (paired by round)"
        )


if __name__ == "__main__":
    main()
