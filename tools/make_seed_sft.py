"""SEED's stage 1: SFT data that teaches the policy to write hindsight skills for its own trajectories.

The base policy plays `--tasks` start states of an environment `--group` times each (the offline pool,
without skills); an annotator writes a skill for each trajectory; every trajectory with a valid skill
becomes one line of `mcore-rl sft`'s jsonl: the prompt is the analyzer's own prompt for that episode
(`agent/hindsight.py`, rendered with the model's chat template, so that stage 2's analyzer asks in the
words stage 1 trained on) and the response is the skill. Then:

    mcore-rl sft configs/sft_demo.yaml data.path=seed_sft.jsonl ...   # the policy that starts RL

Annotators:
- `--annotator rules`: Trace2Skill's rule analysts (`agent/skills.py: analyse`): the path that reached
  the goal, or the move that lost an episode the environment ended; a failure they cannot explain
  (out of turns) has no skill and is dropped, as the paper drops annotations that fail its format check.
- `--annotator-url URL --annotator-model NAME`: an OpenAI-compatible chat endpoint (the paper's external
  LLM), asked with the analyzer's prompt at temperature 0 through the `openai` client; an empty or
  failed answer drops the trajectory.

The policy: `--model DIR` on the embedded engine, or `--policy reader` (tools/trace2skill.py's scripted
random player of a game, no model, the byte tokenizer) to make data without a model.

    python tools/make_seed_sft.py --model runs/smollm2/hf --env frozen_lake --option size=4 \\
        --tasks 180 --group 8 --out runs/seed_sft.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # trace2skill's player, beside this file

from trace2skill import action_reader, add_player_arguments, make_player, play

from mcore_rl.agent.episodes import Episode
from mcore_rl.agent.hindsight import analysis_messages, sft_example
from mcore_rl.config.rl_schema import AnalyzerConfig
from mcore_rl.agent.skills import analyse, trace_of
from mcore_rl.envs import env_prompts


def rule_skill(episode: Episode, actions: tuple[str, ...], success_min: float) -> str | None:
    """The rule analysts' lessons for one episode, one per line; None when they have none."""
    lessons = [p.lesson for p in analyse(trace_of(episode, success_min, action_reader(actions)))]
    return "\n".join(lessons) or None


def endpoint_skill(client: Any, model: str, episode: Episode, settings: AnalyzerConfig) -> str | None:
    """An OpenAI-compatible endpoint's skill for one episode (None: empty or failed)."""
    try:
        reply = client.chat.completions.create(
            model=model,
            messages=analysis_messages(episode, settings),
            temperature=0.0,
            max_tokens=settings.max_new_tokens,
        )
    except Exception as err:  # one trajectory, not the pool
        print(f"annotator failed on episode {episode.prompt.index}/{episode.index}: {err}", file=sys.stderr)
        return None
    text = (reply.choices[0].message.content or "").strip() if reply.choices else ""
    return text or None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_player_arguments(ap)
    ap.add_argument("--tasks", type=int, default=180, help="start states of the offline pool")
    ap.add_argument("--group", type=int, default=8, help="trajectories per start state")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--annotator", default="rules", choices=["rules", "endpoint"])
    ap.add_argument("--annotator-url", default=None, help="OpenAI-compatible base URL (implies --annotator endpoint)")
    ap.add_argument("--annotator-model", default=None, help="the endpoint's model name")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="the skill's budget (as environment.analyzer)")
    ap.add_argument("--success-min", type=float, default=1.0)
    ap.add_argument("--out", required=True, help="the SFT jsonl to write")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    args.k = 0  # trace2skill's player: no library
    if args.annotator_url:
        args.annotator = "endpoint"
    if args.annotator == "endpoint" and not (args.annotator_url and args.annotator_model):
        ap.error("--annotator endpoint needs --annotator-url and --annotator-model")
    if args.tasks < 1 or args.group < 1:
        ap.error("--tasks and --group must be >= 1")

    pool, tok, actions = make_player(args, args.seed)
    client = None
    if args.annotator == "endpoint":
        import openai

        client = openai.OpenAI(base_url=args.annotator_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))

    settings = AnalyzerConfig(max_new_tokens=args.max_new_tokens)
    starts = env_prompts(args.env, **args.options).examples(args.tasks, args.seed)
    played = play(args, pool, tok, starts, args.seed, None)
    kept = dropped = succeeded = 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for e in played:
            succeeded += e.episode_return >= args.success_min
            if e.error is not None or not e.actions:
                dropped += 1
                continue
            if client is not None:
                skill = endpoint_skill(client, args.annotator_model, e, settings)
            else:
                skill = rule_skill(e, actions, args.success_min)
            if skill is None:
                dropped += 1
                continue
            f.write(json.dumps(sft_example(e, skill, tok, settings)) + "\n")
            kept += 1
    print(
        json.dumps(
            {
                "out": args.out,
                "trajectories": len(played),
                "succeeded": succeeded,
                "kept": kept,
                "dropped": dropped,
                "annotator": args.annotator,
            }
        )
    )


if __name__ == "__main__":
    main()
