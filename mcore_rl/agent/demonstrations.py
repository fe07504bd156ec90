"""Demonstrations from an environment's scripted player: the SFT warm start of an environment domain.

A language model that starts from random weights must learn an environment's format (what a valid
turn looks like) before reinforcement has anything to reinforce; a task domain's warm start learns
it from reference answers, an environment has none. Its scripted player (`Environment.demonstrate`)
stands in: it plays episodes from the domain's training prompts (the held-out (prompt, state) pairs
are never among them) through the same `Episode` the rollouts use, so each demonstrated turn is
trained on exactly the ids an RL sample of that turn has: the step's prompt (stepwise: the opening
and the last `memory_k` steps) or the conversation so far, then the player's text and the model's
end-of-turn token. Only those action tokens are targets. An episode whose player writes a turn
longer than `max_tokens_per_turn` is left out (the model could not write it), counted in a warning;
when most are, the warm start stops with that error. A weak player (valid play without the
best strategy) leaves RL something to learn: what the warm start taught is measured against what RL
adds (docs/agent_episodes.md).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import numpy as np

from mcore_rl.agent.episodes import Episode, TurnOutput
from mcore_rl.agent.groups import EpisodeGroups, environment_examples
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.data.domains import DOMAIN_SEED_STRIDE, training_pool, warm_start_share, warm_start_source
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.data.tool_calls import ParsedTurn, render_tool_calls
from mcore_rl.envs import env_has_player

logger = logging.getLogger(__name__)

Row = tuple[list[int], list[int]]  # token ids, and 1 where a token is a training target


class TurnTooLong(ValueError):
    """A player's turn the model could not write within `max_tokens_per_turn`."""


def play(episode: Episode, rng: random.Random) -> list[Row]:
    """One episode played by its environment's scripted player: a row per turn."""
    rows: list[Row] = []
    end = episode.chat.stop_ids[-1:]  # the end of a model turn (ChatML's `<|im_end|>`, else the eos)
    while (request := episode.request()) is not None:
        turn = episode.env.env.demonstrate(rng)
        if turn is None:
            raise ValueError(f"environment {type(episode.env.env).__name__} has no scripted player")
        text = turn if isinstance(turn, str) else render_turn(turn, episode.settings.tool_format)
        ids = episode.chat.encode(text) + end
        cap = episode.settings.max_tokens_per_turn
        if len(ids) > cap:
            episode.close()
            raise TurnTooLong(
                f"the scripted player's turn {text!r} has {len(ids)} tokens, more than a model turn may have "
                f"({cap}: environment.max_tokens_per_turn)"
            )
        if len(ids) > request.sampling_params["max_new_tokens"]:  # the episode's budget is spent, as in a rollout
            episode.cut()
            break
        rows.append((request.input_ids + ids, [0] * len(request.input_ids) + [1] * len(ids)))
        episode.advance(TurnOutput(ids=ids, logps=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop"))
    episode.close()
    return rows


def render_turn(turn: ParsedTurn, tool_format: str) -> str:
    """A player's prose and tool calls as the model writes them in the domain's tool-call format."""
    if not turn.calls:
        return turn.content
    if tool_format == "none":
        raise ValueError("the scripted player calls tools, but the domain's environment.tool_format is 'none'")
    return render_tool_calls(turn.content, turn.calls, tool_format)


def domain_rows(groups: EpisodeGroups, domain: str, pool: Sequence[tuple], n: int, seed: int) -> list[Row]:
    """About `n` demonstrated turns of one environment domain, its pool's prompts in a seeded order."""
    rng = random.Random(seed)
    order = list(range(len(pool)))
    rows: list[Row] = []
    j = skipped = 0
    while len(rows) < n:
        if j % len(order) == 0:
            rng.shuffle(order)
        text, label = pool[order[j % len(order)]][:2]
        (episode,) = groups.episodes(Prompt(j, text, [], label, domain), [{}])
        j += 1
        try:
            rows += play(episode, rng)
        except TurnTooLong:  # an episode the model could not play as the player does: not shown
            skipped += 1
            if skipped > max(20, 2 * (j - skipped)):
                raise
    if skipped:
        logger.warning("domain %r: %d of %d demonstrated episodes skipped (a turn over its cap)", domain, skipped, j)
    return rows[:n]


def environment_rows(cfg: RLConfig, tokenizer: Tokenizer, n: int, seed: int) -> list[Row]:
    """The warm start's demonstrated turns of every environment domain with a player: `n` shared
    with the task domains by the mixture weights (as `data.domains.sft_examples` shares them)."""
    groups = EpisodeGroups.from_config(cfg, tokenizer, capped=False)
    rows: list[Row] = []
    for i, d in enumerate(cfg.data.domains):
        if d.environment is None or not warm_start_source(d, env_has_player) or groups is None:
            continue
        k = warm_start_share(cfg, d, n, env_has_player)
        pool = training_pool(cfg, i, environment_examples)
        rows += domain_rows(groups, d.name, pool, k, seed + i * DOMAIN_SEED_STRIDE)
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[k] for k in order]
