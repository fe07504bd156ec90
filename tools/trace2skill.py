"""Trace2Skill on a shipped environment: held-out success with and without a skill library.

For each seed: the model plays `--group` sampled episodes on each of `--evolve` start states (the
evolve set); `agent/skills.py` turns the traces into a skill library (rule analysts, hierarchical
merge); then it plays the same number of episodes on `--test` other start states (held out: drawn
with another seed) twice, with the same sampling seeds: without the library, and with the `--k`
skills most like each start state before its first message. No weights change. Prints per seed the
success rates (return >= `--success-min`), the library's size, how many held-out start states also
occur in the evolve set, and the mean over seeds with the spread.

    python tools/trace2skill.py --model runs/smollm2/hf --env frozen_lake --option size=4 \\
        --evolve 32 --test 32 --group 4 --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_lockstep
from mcore_rl.agent.skills import SkillLibrary, SkilledEnv, trace_of
from mcore_rl.data.samples import Prompt
from mcore_rl.envs import env_prompts, make_env
from mcore_rl.envs.base import Environment
from mcore_rl.envs.gym_text import GymTextEnv, parse_action


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
            sampling["sampling_seed"] = (seed * 1_000_003 + i * 101 + j) % (2**31 - 1)
            episodes.append(
                Episode(env, prompt, j, seed=seed, tokenizer=tokenizer, settings=settings, sampling=sampling)
            )
    run_lockstep(episodes, pool.generate)
    for e in episodes:
        e.close()
    return episodes


def success(episodes: list[Episode], at_least: float) -> float:
    return sum(e.episode_return >= at_least for e in episodes) / max(len(episodes), 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory (its tokenizer and chat template)")
    ap.add_argument("--env", default="frozen_lake")
    ap.add_argument("--option", action="append", default=[], help="environment option key=value (JSON value)")
    ap.add_argument("--evolve", type=int, default=32, help="start states the library is built from")
    ap.add_argument("--test", type=int, default=32, help="held-out start states")
    ap.add_argument("--group", type=int, default=4, help="episodes per start state")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--k", type=int, default=3, help="skills retrieved into the prompt")
    ap.add_argument("--branching", type=int, default=4, help="B of the hierarchical merge")
    ap.add_argument("--min-support", type=int, default=1, help="drop merged patches seen fewer times")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-turns", type=int, default=10)
    ap.add_argument("--max-tokens-per-turn", type=int, default=24)
    ap.add_argument("--memory-k", type=int, default=0)
    ap.add_argument("--success-min", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=None, help="engine device (default: cuda when there is one)")
    ap.add_argument("--save-library", default=None, help="write the last seed's library (jsonl)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    args.options = dict(parse_option(o) for o in args.option)

    from mcore_rl.data.tokenizer import load_tokenizer  # lazy: the engine stack
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.pool import EmbeddedEnginePool

    tok = load_tokenizer(args.model)
    kw = {"device": args.device} if args.device else {}
    engine = EngineCore.from_model_path(args.model, dtype=args.dtype, max_running_requests=256, **kw)
    pool = EmbeddedEnginePool([engine])
    probe = make_env(args.env, **args.options)
    actions = probe.ACTIONS if isinstance(probe, GymTextEnv) else ()

    def action_of(text: str) -> str:
        found = parse_action(text, actions) if actions else None
        return actions[found] if found is not None else text.strip()[:60]

    rows = []
    source = env_prompts(args.env, **args.options)
    for seed in args.seeds:
        t0 = time.perf_counter()
        evolve = source.examples(args.evolve, 1000 * seed + 1)
        test = source.examples(args.test, 1000 * seed + 2)
        played = play(args, pool, tok, evolve, seed, None)
        library = SkillLibrary.from_traces(
            (trace_of(e, args.success_min, action_of) for e in played), args.branching, args.min_support
        )
        plain = play(args, pool, tok, test, seed, None)
        skilled = play(args, pool, tok, test, seed, library)
        seen = {e.states[0] for e in played if e.states}
        overlap = sum(e.states[0] in seen for e in plain[:: args.group] if e.states) / max(len(test), 1)
        row = {
            "seed": seed,
            "evolve_success": success(played, args.success_min),
            "test_without": success(plain, args.success_min),
            "test_with": success(skilled, args.success_min),
            "skills": len(library.skills),
            "skills_do": sum(p.section == "do" for p in library.skills),
            "test_starts_seen_in_evolve": overlap,
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
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
