"""The episode runner over a real embedded engine (a tiny random model): G episodes from one state,
token-exact conversations, step-wise samples, the guards, a failing environment, partial turns.

Episodes run as the rollout scheduler runs them: one `run_episode` coroutine each, every turn through
the embedded pool's `agenerate`, stepped from the event loop (the requests of a turn's episodes join
the engine together)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from mcore_rl.agent.episodes import Episode, EpisodeSettings, episode_metrics, run_episode
from mcore_rl.algos.step_credit import state_key
from mcore_rl.data.samples import Prompt
from mcore_rl.envs.base import AgentAction, Environment, EnvReset, EnvStep
from mcore_rl.rollout.pool import EmbeddedEnginePool, Generation, GenRequest
from tests.helpers import TOK, make_engine


@dataclass
class CountdownEnv(Environment):
    """Answers every turn with the number of turns left; the reward is the number of turns the model
    needed to say a digit (0 if never); `fail_at` raises at that turn, `invalid` marks every turn invalid."""

    turns: int = 3
    fail_at: int | None = None
    fail_reset: bool = False
    invalid: bool = False
    seen: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    closed: int = 0

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        self.seeds.append(seed)
        if self.fail_reset:
            raise ValueError("no such secret")
        return EnvReset([{"role": "user", "content": f"count {prompt.label}"}], state=f"left {self.turns}")

    def step(self, action: AgentAction) -> EnvStep:
        self.seen.append(action.text)
        if self.fail_at is not None and len(self.seen) == self.fail_at:
            raise RuntimeError("the environment broke")
        left = self.turns - len(self.seen)
        info: dict[str, Any] = {"events": {"invalid_action": 1}} if self.invalid else {}
        digit = any(ch.isdigit() for ch in action.text)
        return EnvStep(
            [{"role": "user", "content": f"{left} left"}],
            reward=1.0 if digit else 0.0,
            done=left <= 0,
            state=f"left {left}",
            info=info,
        )

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def pool() -> EmbeddedEnginePool:
    return EmbeddedEnginePool([make_engine(context_length=256)])


class Recorder:
    """The pool's `agenerate`, keeping every request and generation it saw."""

    def __init__(self, pool: EmbeddedEnginePool) -> None:
        self.pool = pool
        self.requests: list[GenRequest] = []
        self.gens: list[Generation] = []

    async def __call__(self, req: GenRequest) -> Generation:
        gen = await self.pool.agenerate(req)
        self.requests.append(req)
        self.gens.append(gen)
        return gen


def run(eps: list[Episode], pool: EmbeddedEnginePool, recorder: Recorder | None = None) -> None:
    """Every episode to its end, concurrently, through the pool (the production driver)."""
    generate = recorder if recorder is not None else pool.agenerate

    async def main() -> None:
        await asyncio.gather(*(run_episode(e, generate) for e in eps))

    asyncio.run(main())


PROMPT = Prompt(index=11, text="count", ids=[1], label=5, domain="count")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 5}


def episodes(envs: list[CountdownEnv], settings: EpisodeSettings) -> list[Episode]:
    return [
        Episode(env, PROMPT, j, seed=99, tokenizer=TOK, settings=settings, sampling=dict(SAMPLING, sampling_seed=5 + j))
        for j, env in enumerate(envs)
    ]


def test_conversation_episodes_are_token_exact_and_trained_only_at_model_tokens(pool):
    envs = [CountdownEnv() for _ in range(3)]
    eps = episodes(envs, EpisodeSettings(max_tokens_per_turn=6, max_episode_tokens=200))
    rec = Recorder(pool)
    run(eps, pool, rec)
    assert [e.seeds for e in envs] == [[99]] * 3  # the group starts from one seeded state
    assert all(e.finish == "done" and e.turns == 3 and env.closed == 1 for e, env in zip(eps, envs))
    samples = [s for e in eps for s in e.samples()]
    assert len(samples) == 3 and [s.episode for s in samples] == [0, 1, 2]
    by_episode: dict[int, list[list[int]]] = {0: [], 1: [], 2: []}
    for req, gen in zip(rec.requests, rec.gens):  # the turn's seed names the episode
        j = (req.sampling_params["sampling_seed"] - 5) % 7919
        by_episode[j].append(list(gen.output_ids))
    for s, e in zip(samples, eps):
        model = [i for i, t in zip(s.response_ids, s.trainable or []) if t]
        assert model == [i for out in by_episode[s.episode or 0] for i in out]  # the engine's ids, as they are
        assert s.group == 11 and s.step_index == 0 and s.reward == e.episode_return
        assert s.reward_heads == {"environment": e.episode_return} and s.reward_error is None
        assert TOK.decode(s.response_ids).count("left<|im_end|>") == 2  # two observations in between
        # the request of each turn continued the whole conversation so far: prompt + response before it
        full = s.prompt_ids + s.response_ids
        for req in rec.requests:
            if (req.sampling_params["sampling_seed"] - 5) % 7919 == s.episode:
                assert full[: len(req.input_ids)] == req.input_ids
    m = episode_metrics([samples])
    assert m["episode/count"] == 3 and m["episode/turns_mean"] == 3 and m["episode/finish/done"] == 3


def test_stepwise_samples_carry_episode_step_state_and_a_memory_of_k_steps(pool):
    envs = [CountdownEnv(turns=4) for _ in range(2)]
    eps = episodes(envs, EpisodeSettings(trajectory="stepwise", memory_k=1, max_tokens_per_turn=5))
    run(eps, pool)
    for e in eps:
        ss = e.samples()
        assert [s.step_index for s in ss] == [0, 1, 2, 3] and {s.episode for s in ss} == {e.index}
        assert [s.info["state"] for s in ss] == ["left 4", "left 3", "left 2", "left 1"]
        assert [s.info["state_key"] for s in ss] == [state_key(s.info["state"]) for s in ss]  # step-level credit
        assert [s.info["step_reward"] for s in ss] == e.rewards and len(e.rewards) == 4
        assert all(s.trainable is None for s in ss)  # a step's response is the model's turn alone
        assert ss[0].finish_reason == "step" and ss[-1].finish_reason == "done"
        text = [TOK.decode(s.prompt_ids) for s in ss]
        assert "left" not in text[0] and text[1].count(" left<|im_end|>") == 1
        assert "3 left" in text[1] and "2 left" in text[2] and "3 left" not in text[2]  # only the last K=1 step


def test_guards_end_episodes_with_their_reason(pool):
    many = episodes([CountdownEnv(turns=99)], EpisodeSettings(max_turns=2, max_tokens_per_turn=4))
    invalid = episodes(
        [CountdownEnv(turns=99, invalid=True)], EpisodeSettings(max_invalid_calls=2, max_tokens_per_turn=4)
    )
    budget = episodes([CountdownEnv(turns=99)], EpisodeSettings(max_tokens_per_turn=8, max_episode_tokens=30))
    run(many + invalid + budget, pool)
    assert (many[0].finish, many[0].turns) == ("max_turns", 2)
    assert (invalid[0].finish, invalid[0].turns, invalid[0].invalid) == ("invalid_calls", 2, 2)
    penalised = episodes([CountdownEnv(turns=2, invalid=True)], EpisodeSettings(invalid_penalty=0.25))
    stepwise = EpisodeSettings(invalid_penalty=0.25, trajectory="stepwise", max_tokens_per_turn=4)
    penalised += episodes([CountdownEnv(turns=2, invalid=True)], stepwise)
    run(penalised, pool)
    assert penalised[0].episode_return == sum(penalised[0].rewards) - 0.5
    steps = penalised[1].samples()  # each step's own reward carries its turn's penalty
    assert [s.info["step_reward"] for s in steps] == [r - 0.25 for r in penalised[1].rewards]
    assert sum(s.info["step_reward"] for s in steps) == penalised[1].episode_return
    assert budget[0].finish == "length"
    (s,) = budget[0].samples()
    assert len(s.response_ids) <= 30 and s.finish_reason == "length"


def test_no_sample_is_longer_than_the_learner_row_however_long_the_history(pool):
    """A stepwise step's prompt grows with the history it shows (no config check can bound it): every
    turn's budget is cut to what fits `max_sample_tokens`, and an episode whose next prompt leaves no room
    ends there ("length") with the samples it has, rather than one the learner cannot pack."""
    cap = 120
    settings = EpisodeSettings(trajectory="stepwise", memory_k=8, max_tokens_per_turn=12, max_sample_tokens=cap)
    eps = episodes([CountdownEnv(turns=30) for _ in range(2)], settings)
    conversation = episodes(
        [CountdownEnv(turns=30)], EpisodeSettings(max_tokens_per_turn=12, max_episode_tokens=500, max_sample_tokens=cap)
    )
    run(eps + conversation, pool)
    for e in eps + conversation:
        samples = e.samples()
        assert e.finish == "length" and samples and e.turns < 30
        assert all(len(s.prompt_ids) + len(s.response_ids) <= cap for s in samples)
    assert len(eps[0].samples()) >= 2  # the first turns fit whole; the cap ends it later
    unfit = episodes([CountdownEnv(turns=3)], EpisodeSettings(trajectory="stepwise", max_sample_tokens=5))
    run(unfit, pool)
    assert unfit[0].finish == "length" and all(len(s.prompt_ids) + len(s.response_ids) <= 5 for s in unfit[0].samples())


def test_an_environment_that_raises_costs_its_episode_not_the_group(pool):
    envs = [CountdownEnv(fail_at=2), CountdownEnv()]
    eps = episodes(envs, EpisodeSettings(max_tokens_per_turn=4))
    run(eps, pool)
    bad, good = eps
    assert bad.finish == "env_error" and envs[0].closed == 1
    (s,) = bad.samples()
    assert s.reward_error == "env_error: RuntimeError: the environment broke"
    assert episode_metrics([[s]])["episode/events/env_error"] == 1
    assert good.finish == "done" and good.samples()[0].reward_error is None
    # a reset that raises: the episode is over before its first turn; one empty sample the learner
    # leaves out (no tokens, finish "abort") keeps the group's shape and names the reason
    broken = episodes([CountdownEnv(fail_reset=True), CountdownEnv()], EpisodeSettings(max_tokens_per_turn=4))
    run(broken, pool)
    (lost,) = broken[0].samples()
    assert broken[0].finish == "env_error" and broken[0].turns == 0 and broken[1].finish == "done"
    assert lost.response_ids == [] and lost.finish_reason == "abort"
    assert lost.reward_error == "env_error: ValueError: no such secret" and lost.episode == 0


def test_a_turn_aborted_by_a_weight_sync_is_continued_with_its_tokens_versions(pool):
    """The asynchronous driver: the engine aborts the first request of every turn after 2 tokens (as
    `pause_generation(abort)` does at a sync); the turn goes on from its tokens under version 1."""
    calls: list[GenRequest] = []
    abort_next = [True]

    async def generate(req: GenRequest) -> Generation:
        calls.append(req)
        (gen,) = pool.generate([req])
        if abort_next[0] and len(gen.output_ids) > 2:
            abort_next[0] = False
            gen.output_ids, gen.output_logprobs = gen.output_ids[:2], gen.output_logprobs[:2]
            gen.finish_reason, gen.output_versions = "abort", [0, 0]
            return gen
        abort_next[0] = True  # the next turn's first request is cut again
        gen.weight_version, gen.output_versions = 1, None
        return gen

    env = CountdownEnv(turns=2)
    (e,) = episodes([env], EpisodeSettings(max_tokens_per_turn=8, max_episode_tokens=200))
    asyncio.run(run_episode(e, generate))
    assert e.finish == "done" and e.turns == 2
    (s,) = e.samples()
    aborted = [i for i in range(len(calls) - 1) if calls[i + 1].input_ids[:-2] == calls[i].input_ids]
    assert aborted, "no turn was continued"
    assert e.continued == len(aborted) and s.info["episode/continued_requests"] == len(aborted)
    assert s.token_versions is not None and s.policy_version == 0  # the oldest token counts for staleness
    model_versions = [v for v, t in zip(s.token_versions, s.trainable or []) if t]
    assert model_versions[:2] == [0, 0] and 1 in model_versions


def test_the_learner_masks_every_token_the_model_did_not_sample(pool):
    """The sequence view's response mask (loss, KL, entropy, advantage broadcast) is `Sample.trainable`."""
    from mcore_rl.train.packing import sequence_view

    (e,) = episodes([CountdownEnv()], EpisodeSettings(max_tokens_per_turn=4))
    run([e], pool)
    (s,) = e.samples()
    plain = s.__class__(PROMPT, 11, [65, 66], [-1.0, -1.0], 0, "stop")
    view = sequence_view([s, plain])
    assert view.mask[0, : len(s.response_ids)].tolist() == [float(t) for t in s.trainable or []]
    assert 0 < view.mask[0].sum() < len(s.response_ids)  # observation tokens are out
    assert view.mask[1].tolist()[:2] == [1.0, 1.0] and view.mask[1].sum() == 2
