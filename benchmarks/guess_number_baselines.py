"""Reference policies on guess-the-number: the chance level and the ceiling a trained model is read against.

Each policy plays the environment itself (`make_env("guess_number", ...)`, the same feedback and
rules as in training) on prompts drawn from the environment's prompt source, and the share of solved
games is printed. The defaults are `configs/agentic_demo.yaml`'s options.

    python benchmarks/guess_number_baselines.py
    python benchmarks/guess_number_baselines.py --options '{"lo": 1, "hi": 8, "max_guesses": 4}'
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn
from mcore_rl.envs import env_prompts, make_env
from mcore_rl.envs.base import AgentAction

DEMO = {"lo": 1, "hi": 9, "min_span": 6, "max_guesses": 3, "feedback": "interval"}

# a policy: (range low, range high, open low, open high, rng) -> the guess
Policy = Callable[[int, int, int, int, random.Random], int]
POLICIES: dict[str, Policy] = {
    "uniform in the range, feedback ignored": lambda lo, hi, a, b, rng: rng.randint(lo, hi),
    "uniform in the numbers still open": lambda lo, hi, a, b, rng: rng.randint(a, b),
    "the lowest number still open": lambda lo, hi, a, b, rng: a,
    "binary search (the middle of the open numbers)": lambda lo, hi, a, b, rng: (a + b) // 2,
}


def solved(policy: Policy, options: dict[str, object], text: str, label: object, rng: random.Random) -> bool:
    env = make_env("guess_number", **options)
    start = env.reset(Prompt(0, text, [], label), seed=0)
    lo, hi = (int(x) for x in start.state.split("-"))
    a, b = lo, hi
    while True:
        guess = str(policy(lo, hi, a, b, rng))
        step = env.step(AgentAction(guess, ParsedTurn(content=guess)))
        if step.done:
            return bool(step.info.get("solved"))
        if step.state != "solved" and "-" in step.state:
            a, b = (int(x) for x in step.state.split("-"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--options", default=json.dumps(DEMO), help="the environment's options, as JSON")
    ap.add_argument("--games", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    options = json.loads(args.options)
    games = env_prompts("guess_number", **options).examples(args.games, args.seed)
    print(f"guess_number {options}, {args.games} games from the prompt source (seed {args.seed})")
    for name, policy in POLICIES.items():
        rng = random.Random(args.seed)
        rate = sum(solved(policy, options, text, label, rng) for text, label in games) / len(games)
        print(f"{name:48s} {rate:6.1%}")


if __name__ == "__main__":
    main()
