"""The per-turn baseline bias on guess-the-number: which advantage estimators keep the episode's own return.

When the policy decides when an episode stops (here: a right guess ends it, so solved games are
short), a baseline whose terms depend on the episode's own length is action-dependent and biases the
gradient. The construction that does this (per-turn-index normalisation, as in MT-GRPO and the verl
RFC on per-turn rewards) subtracts from the return-to-go of turn t the sum of the group's mean step
rewards b_u over the turns u >= t the episode itself went on to play: A_t = Σ_{u=t}^{T-1} (r_u − b_u).
Every turn an episode plays adds −b_u, a hidden bonus for going on whenever intermediate rewards are
negative on average (here: the invalid-turn penalty).

A scripted player (the environment's "open" player, invalid with probability `--p-invalid`: an
unreadable turn costs `invalid_penalty` 0.1) plays the agentic demo's games through the real
`Episode` and environment, G episodes per group from one seeded state, step-wise samples. For each
estimator (mean-only, so the numbers are in reward units) the table gives, per episode length T,
the mean advantage of the episode's first step against the return's own difference E[R|T] − E[R]:

* `grpo` on the step samples (`algorithm.advantage: grpo` on a step-wise domain): an episode counts
  once per step in its group's mean, so the baseline leans to the long (unsolved) episodes — a shift;
* per episode (`gigpo` with `step_weight: 0`): each episode once; (1 − 1/G)(E[R|T] − E[R]) in
  expectation (its own return is 1/G of the baseline);
* per turn index (the counter-example, not an estimator of the package);
* `gigpo` (ω = 1, γ = 0.95) and `gagpo` (γ = 0.95, λ = 0.8, mean-only), the step-level estimators.

    python benchmarks/turn_baseline_bias.py
    python benchmarks/turn_baseline_bias.py --groups 4000 --p-invalid 0.3 --seed 1
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import torch

from mcore_rl import algos
from mcore_rl.agent.episodes import Episode, EpisodeSettings, TurnOutput, step_batch
from mcore_rl.algos.step_credit import StepBatch, effective_step_rewards, episodes
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.envs import env_prompts, make_env

# configs/agentic_demo.yaml's environment
DEMO = {"lo": 1, "hi": 9, "min_span": 6, "max_guesses": 3, "feedback": "interval", "fresh_secret": True}
SETTINGS = EpisodeSettings(
    max_turns=3, max_tokens_per_turn=4, trajectory="stepwise", memory_k=0, invalid_penalty=0.1, max_invalid_calls=3
)


def play_groups(groups: int, group_size: int, p_invalid: float, seed: int) -> list[Sample]:
    """The step samples of `groups` groups of `group_size` episodes each, in group order."""
    tok = load_tokenizer(None)
    rng = random.Random(seed)
    out: list[Sample] = []
    for g, (text, label) in enumerate(env_prompts("guess_number", **DEMO).examples(groups, seed)):
        prompt = Prompt(g, text, [], label, "guess")
        reset = rng.randrange(2**31 - 1)  # one initial state (secret) per group
        for j in range(group_size):
            episode = Episode(make_env("guess_number", **DEMO), prompt, j, reset, tok, SETTINGS, {})
            end = episode.chat.stop_ids[-1:]
            while episode.request() is not None:
                turn = "?" if rng.random() < p_invalid else episode.env.env.demonstrate(rng)
                ids = episode.chat.encode(str(turn)) + end
                episode.advance(TurnOutput(ids, [0.0] * len(ids), [0] * len(ids), "stop"))
            episode.close()
            out += episode.samples()
    return out


def per_turn_index(rewards: torch.Tensor, group_ids: torch.Tensor, steps: StepBatch) -> torch.Tensor:
    """The counter-example: A_t = Σ_{u>=t} (r_u − b_u) over the turns the episode played, b_u the mean
    step reward at turn index u over the group's episodes that reached it."""
    r = effective_step_rewards(rewards, group_ids, steps)
    turn = [(int(g), int(t)) for g, t in zip(group_ids, steps.step)]
    at: dict[tuple[int, int], list[float]] = {}
    for k, x in zip(turn, r.tolist()):
        at.setdefault(k, []).append(x)
    centred = r - torch.tensor([sum(at[k]) / len(at[k]) for k in turn], dtype=torch.float64)
    out = centred.clone()
    for ix in episodes(group_ids, steps):
        for a, c in zip(reversed(ix[:-1]), reversed(ix[1:])):
            out[a] += out[c]
    return out


# the mean-only baselines whose deviation from (1 - 1/G)(E[R|T] - E[R]) the table shows: a deviation
# that is the same for every T shifts all advantages alike (no bias: E[Σ_t ∇log π(a_t|s_t)] = 0); one
# that changes with T rewards or punishes playing more turns beyond what the return says
BASELINES = ("grpo over step samples", "per episode (gigpo, step_weight 0)", "per turn index (counter-example)")


def estimators() -> dict[str, Callable[[torch.Tensor, torch.Tensor, StepBatch], torch.Tensor]]:
    def named(name: str, **options: object) -> Callable[[torch.Tensor, torch.Tensor, StepBatch], torch.Tensor]:
        fn = algos.get("advantage", name)
        if name == "grpo":
            return lambda r, g, s: fn(r, g, normalize_std=False).double()
        return lambda r, g, s: fn(r, g, normalize_std=False, steps=s, **options).double()

    return {
        "grpo over step samples": named("grpo"),
        "per episode (gigpo, step_weight 0)": named("gigpo", step_weight=0.0),
        "per turn index (counter-example)": per_turn_index,
        "gigpo (step_weight 1)": named("gigpo"),
        "gagpo": named("gagpo"),
    }


def bias_table(samples: list[Sample], group_size: int) -> dict[str, dict[int, float]]:
    """{row: {episode length T: value}}: the share of episodes, E[R|T] − E[R], each estimator's mean
    first-step advantage over the episodes of length T, and the baselines' deviations."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    group_ids = torch.tensor([s.group for s in samples])
    steps = step_batch(samples)
    first = [i for i, s in enumerate(samples) if s.step_index == 0]
    turns = torch.tensor([int(samples[i].info["episode/turns"]) for i in first])
    ret = rewards[first]
    out: dict[str, dict[int, float]] = {"share of episodes": {}, "E[R|T] - E[R]": {}}
    lengths = sorted(set(turns.tolist()))
    for t in lengths:
        at = turns == t
        out["share of episodes"][t] = float(at.double().mean())
        out["E[R|T] - E[R]"][t] = float(ret[at].mean() - ret.mean())
    for name, fn in estimators().items():
        adv = fn(rewards, group_ids, steps)[first]
        out[name] = {t: float(adv[turns == t].mean()) for t in lengths}
    shrink = 1 - 1 / group_size  # an episode's own return is 1/G of a per-episode group mean
    for name in BASELINES:
        out[f"{name}: deviation"] = {t: out[name][t] - shrink * out["E[R|T] - E[R]"][t] for t in lengths}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--p-invalid", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    samples = play_groups(args.groups, args.group_size, args.p_invalid, args.seed)
    table = bias_table(samples, args.group_size)
    lengths = sorted(table["share of episodes"])
    print(
        f"guess_number {DEMO}, invalid_penalty 0.1, {args.groups} groups x {args.group_size} episodes, "
        f"p_invalid {args.p_invalid}, seed {args.seed}"
    )
    print("| row | " + " | ".join(f"T = {t}" for t in lengths) + " |")
    print("| --- |" + " --- |" * len(lengths))
    for row, values in table.items():
        print(f"| {row} | " + " | ".join(f"{values[t]:+.3f}" for t in lengths) + " |")


if __name__ == "__main__":
    main()
