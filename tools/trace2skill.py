"""Trace2Skill on a shipped environment: held-out success with and without a skill library.

For each seed: the model plays `--group` sampled episodes on each of `--evolve` start states (the
evolve set); `agent/skills.py` turns the traces into a skill library (rule analysts, hierarchical
merge); then it plays the same number of episodes on `--test` other start states (held out: drawn
with another seed) twice, with the same sampling seeds: without the library, and with the `--k`
skills most like each start state before its first message. No weights change. Prints per seed the
success rates (return >= `--success-min`), the library's size, how many held-out start states also
occur in the evolve set (and the rates on those that do not), and the mean over seeds with the spread.

Two policies: `--model DIR`, a language model on the embedded engine (it reads the skills as text);
`--policy reader`, no model: a scripted player of a game that moves at random, and with the library
plays the moves of the first `do` skill retrieved for its start state, then at random. The reader
measures what the library holds for held-out states (does retrieval find a path that works
there), not whether a model can use it.

    python tools/trace2skill.py --model runs/smollm2/hf --env frozen_lake --option size=4 \\
        --evolve 32 --test 32 --group 4 --seeds 1 2 3
    python tools/trace2skill.py --policy reader --env frozen_lake --option size=4 --evolve 128 --test 64
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_lockstep
from mcore_rl.agent.skills import SkillLibrary, library_from_traces, trace_of
from mcore_rl.data.samples import Prompt
from mcore_rl.envs import env_prompts, make_env
from mcore_rl.envs.base import Environment
from mcore_rl.envs.gym_text import GymTextEnv, parse_action
from mcore_rl.envs.skills import SkilledEnv


def parse_option(text: str) -> tuple[str, Any]:
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def play(
    args: argparse.Namespace,
    pool: Any,
    tokenizer: Any,
    starts: list[tuple[str, Any]],
    seed: int,
    library: SkillLibrary | None,
) -> list[Episode]:
    """`args.group` episodes per start state, every one to its end, batched."""
    settings = EpisodeSettings(
        trajectory="stepwise",
        memory_k=args.memory_k,
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn,
        max_invalid_calls=args.max_turns,
    )
    episodes = []
    for i, (text, label) in enumerate(starts):
        for j in range(args.group):
            env: Environment = make_env(args.env, **args.options)
            if library is not None:
                env = SkilledEnv(env, library, args.k)
            prompt = Prompt(index=i, text=text, ids=[], label=label, domain=args.env)
            sampling = {"temperature": args.temperature, "top_p": 1.0, "top_k": -1}
            base = len(episodes)
            sampling["sampling_seed"] = base if isinstance(pool, Reader) else (seed * 1_000_003 + base) % (2**31 - 1)
            e = Episode(env, prompt, j, seed=seed, tokenizer=tokenizer, settings=settings, sampling=sampling)
            if isinstance(pool, Reader):
                pool.plan(base, library, e.states[0] if e.states else "", args.k)
            episodes.append(e)
    if isinstance(pool, Reader) and len(episodes) >= 7919:
        raise SystemExit("--policy reader: at most 7918 episodes per set")
    run_lockstep(episodes, pool.generate)
    for e in episodes:
        e.close()
    return episodes


class Reader:
    """`--policy reader`: the scripted player (see the module docstring), as a batch `generate` over the
    byte tokenizer; an episode is found by its sampling seed (base + 7919 × turn, `Episode.request`)."""

    def __init__(self, tokenizer: Any, actions: tuple[str, ...], seed: int) -> None:
        self.tokenizer, self.actions, self.seed = tokenizer, actions, seed
        self.plans: dict[int, list[str]] = {}

    def plan(self, base: int, library: SkillLibrary | None, state: str, k: int) -> None:
        moves: list[str] = []
        for p in library.retrieve(state, k) if library is not None else []:
            found = re.search(r"reached the goal: (.*)\.$", p.lesson)
            if p.section == "do" and found:
                moves = [m.strip() for m in found.group(1).split(",")]
                break
        self.plans[base] = moves

    def generate(self, requests: list[Any]) -> list[Any]:
        from mcore_rl.rollout.pool import Generation

        out = []
        for req in requests:
            s = int(req.sampling_params["sampling_seed"])
            base, turn = s % 7919, s // 7919
            plan = self.plans.get(base, [])
            rng = random.Random(self.seed * 7_919_000 + s)
            move = plan[turn] if turn < len(plan) else rng.choice(self.actions)
            ids = self.tokenizer.encode(move)
            out.append(Generation(ids, [0.0] * len(ids), 0, "stop", move, "reader"))
        return out


def success(episodes: list[Episode], at_least: float) -> float:
    return sum(e.episode_return >= at_least for e in episodes) / max(len(episodes), 1)


def add_player_arguments(ap: argparse.ArgumentParser) -> None:
    """The player's flags, shared with tools/make_seed_sft.py."""
    ap.add_argument("--policy", default="model", choices=["model", "reader"])
    ap.add_argument("--model", default=None, help="--policy model: HF checkpoint directory (tokenizer, template)")
    ap.add_argument("--env", default="frozen_lake")
    ap.add_argument("--option", action="append", default=[], help="environment option key=value (JSON value)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-turns", type=int, default=10)
    ap.add_argument("--max-tokens-per-turn", type=int, default=24)
    ap.add_argument("--memory-k", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=None, help="engine device (default: cuda when there is one)")


def make_player(args: argparse.Namespace, seed: int) -> tuple[Any, Any, tuple[str, ...]]:
    """(pool, tokenizer, the game's actions) of `add_player_arguments`' flags; sets `args.options`."""
    from mcore_rl.data.tokenizer import load_tokenizer  # lazy: the engine stack

    args.options = dict(parse_option(o) for o in args.option)
    probe = make_env(args.env, **args.options)
    actions = probe.ACTIONS if isinstance(probe, GymTextEnv) else ()
    if args.policy == "reader":
        if not actions:
            raise SystemExit("--policy reader plays the games (frozen_lake, taxi) only")
        tok = load_tokenizer(None)
        return Reader(tok, actions, seed), tok, actions
    if args.model is None:
        raise SystemExit("--policy model needs --model")
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.pool import EmbeddedEnginePool

    tok = load_tokenizer(args.model)
    kw = {"device": args.device} if args.device else {}
    engine = EngineCore.from_model_path(args.model, dtype=args.dtype, max_running_requests=256, **kw)
    return EmbeddedEnginePool([engine]), tok, actions


def action_reader(actions: tuple[str, ...]) -> Callable[[str], str]:
    """A turn's text -> the game's move it names (else its first 60 characters)."""

    def action_of(text: str) -> str:
        found = parse_action(text, actions) if actions else None
        return actions[found] if found is not None else text.strip()[:60]

    return action_of


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_player_arguments(ap)
    ap.add_argument("--evolve", type=int, default=32, help="start states the library is built from")
    ap.add_argument("--test", type=int, default=32, help="held-out start states")
    ap.add_argument("--group", type=int, default=4, help="episodes per start state")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--k", type=int, default=3, help="skills retrieved into the prompt")
    ap.add_argument("--branching", type=int, default=4, help="B of the hierarchical merge")
    ap.add_argument("--min-support", type=int, default=1, help="drop merged patches seen fewer times")
    ap.add_argument("--success-min", type=float, default=1.0)
    ap.add_argument("--save-library", default=None, help="write the last seed's library (jsonl)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    args.options = dict(parse_option(o) for o in args.option)

    pool, tok, actions = make_player(args, args.seeds[0])
    action_of = action_reader(actions)

    rows = []
    source = env_prompts(args.env, **args.options)
    for seed in args.seeds:
        t0 = time.perf_counter()
        evolve = source.examples(args.evolve, 1000 * seed + 1)
        test = source.examples(args.test, 1000 * seed + 2)
        if isinstance(pool, Reader):
            pool.seed = seed
        played = play(args, pool, tok, evolve, seed, None)
        library = library_from_traces(
            (trace_of(e, args.success_min, action_of) for e in played), args.branching, args.min_support
        )
        plain = play(args, pool, tok, test, seed, None)
        skilled = play(args, pool, tok, test, seed, library)
        seen = {e.states[0] for e in played if e.states}
        overlap = sum(e.states[0] in seen for e in plain[:: args.group] if e.states) / max(len(test), 1)
        new_plain = [e for e in plain if e.states and e.states[0] not in seen]
        new_skilled = [e for e in skilled if e.states and e.states[0] not in seen]
        row = {
            "seed": seed,
            "evolve_success": success(played, args.success_min),
            "test_without": success(plain, args.success_min),
            "test_with": success(skilled, args.success_min),
            "skills": len(library.skills),
            "skills_do": sum(p.section == "do" for p in library.skills),
            "test_starts_seen_in_evolve": overlap,
            "unseen_test_without": success(new_plain, args.success_min),
            "unseen_test_with": success(new_skilled, args.success_min),
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.save_library:
            library.save(args.save_library)
    if len(rows) > 1:
        diffs = [r["test_with"] - r["test_without"] for r in rows]
        print(
            f"held-out success without {statistics.mean(r['test_without'] for r in rows):.1%}, "
            f"with {statistics.mean(r['test_with'] for r in rows):.1%}; "
            f"with - without {statistics.mean(diffs):+.1%} (min {min(diffs):+.1%}, max {max(diffs):+.1%}) "
            f"over {len(rows)} seeds"
        )
        unseen = [r["unseen_test_with"] - r["unseen_test_without"] for r in rows]
        print(
            f"on held-out start states not in the evolve set: with - without {statistics.mean(unseen):+.1%} "
            f"(min {min(unseen):+.1%}, max {max(unseen):+.1%})"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
