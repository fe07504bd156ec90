"""The rollout manager: prompts -> G completions each from the engine(s) -> rewards -> groups.

Runs on global rank 0 (which holds the engines). Each completion becomes a `Sample` carrying its
provenance: the weight version the engine generated it with and μ, the engine's log-prob of every
response token. Sampling is seeded per sample from (run seed, purpose, prompt stream index, sample
index), so the same prompt at the same step draws the same tokens in a rerun or a resumed run.

Rewards come from a `RewardRunner`, which calls a sync reward in worker processes that it kills
at the timeout: a verifier that raises, hangs or exits marks its sample with `reward_error` (and
`error_reward`), and the run goes on. With dynamic sampling (DAPO), groups whose
rewards are all equal are dropped and more prompts are drawn until the batch is full or the round
budget is spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mcore_rl.algos.dynamic_sampling import GroupRefill
from mcore_rl.data.prompts import PromptSource
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, get_reward_fn
from mcore_rl.rollout.pool import EnginePool, GenRequest

# salts that keep the sampling seeds of different purposes apart
SALT_TRAIN, SALT_VALIDATION, SALT_EVAL = 1, 2, 3


def sample_seed(seed: int, salt: int, index: int, j: int) -> int:
    return int(np.random.SeedSequence([seed, salt, index, j]).generate_state(1)[0] % (2**31 - 1))


def build_reward_runner(cfg: Any) -> RewardRunner:
    """The runner of `reward.name` (task rewards are registered by importing `mcore_rl.data.tasks`)."""
    import mcore_rl.data.tasks  # noqa: F401

    rc = cfg.reward
    runner = RewardRunner(
        RewardFunction(get_reward_fn(rc.name), timeout_s=rc.timeout_s, error_reward=rc.error_reward, name=rc.name),
        max_concurrency=rc.max_concurrency,
    )
    runner.start()  # the workers load the function while the engines start
    return runner


@dataclass
class RolloutStats:
    prompts_drawn: int = 0
    groups_kept: int = 0
    rounds: int = 0
    seconds_generate: float = 0.0
    seconds_reward: float = 0.0
    fallback: bool = False  # dynamic sampling kept no group; the last round was used unfiltered

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/prompts_drawn": float(self.prompts_drawn),
            "rollout/groups_kept": float(self.groups_kept),
            "rollout/rounds": float(self.rounds),
            "time/generate_s": self.seconds_generate,
            "time/reward_s": self.seconds_reward,
            "rollout/dynamic_sampling_fallback": float(self.fallback),
        }


class RolloutManager:
    """Generates and scores groups of samples (rank 0 only)."""

    def __init__(self, engines: EnginePool, prompts: PromptSource, rewards: RewardRunner, cfg: Any) -> None:
        self.engines, self.prompts, self.rewards, self.cfg = engines, prompts, rewards, cfg
        self.step = 0  # the rollout step being collected (the distillation horizon grows with it)

    def budget(self, prompt: Prompt) -> int:
        """New tokens of a training rollout of `prompt`: its budget, cut at the distillation horizon."""
        from mcore_rl.train.distillation import generation_budget

        return generation_budget(self.cfg, prompt, self.step)

    def sampling_params(self, temperature: float, seed: int | None, max_new_tokens: int | None = None) -> dict[str, Any]:
        """SGLang sampling parameters; `max_new_tokens`: the prompt's own budget (at most the rollout's)."""
        r = self.cfg.rollout
        sp: dict[str, Any] = {"temperature": temperature, "max_new_tokens": min(max_new_tokens or r.max_new_tokens,
                                                                                 r.max_new_tokens)}
        if temperature > 0:
            sp.update(top_p=r.top_p, top_k=r.top_k)
            if seed is not None:
                sp["sampling_seed"] = seed
        return sp

    def generate(self, prompts: Sequence[Prompt], n: int, temperature: float, salt: int,
                 train: bool = False) -> list[list[Sample]]:
        """n completions of each prompt, scored: one group per prompt, in prompt order (`train`:
        training rollouts, cut at the distillation horizon)."""
        import time

        seed = self.cfg.train.seed
        reqs = [GenRequest(p.ids, self.sampling_params(temperature, sample_seed(seed, salt, p.index, j),
                                                       self.budget(p) if train else p.max_new_tokens))
                for p in prompts for j in range(n)]
        start = time.perf_counter()
        gens = self.engines.generate(reqs)
        self.last_generate_s = time.perf_counter() - start
        samples = []
        for k, g in enumerate(gens):
            p = prompts[k // n]
            lp = list(g.output_logprobs)
            if len(lp) != len(g.output_ids):
                raise RuntimeError(f"engine {g.engine} returned {len(lp)} log-probs for {len(g.output_ids)} tokens")
            samples.append(Sample(p, p.index, list(g.output_ids), lp, g.weight_version, g.finish_reason, g.text, g.engine))
        start = time.perf_counter()
        self.score(samples)
        self.last_reward_s = time.perf_counter() - start
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def score(self, samples: list[Sample]) -> None:
        inputs = [RewardInput(s.prompt.text, s.text, s.prompt.label, {"finish_reason": s.finish_reason}) for s in samples]
        for s, res in zip(samples, self.rewards.score_sync(inputs, [s.group for s in samples])):
            s.reward, s.reward_error, s.info = res.reward, res.error, dict(res.info)

    def collect(self) -> tuple[list[list[Sample]], RolloutStats]:
        """One rollout batch: `prompts_per_step` groups of `group_size` (dynamic sampling: groups
        with non-constant rewards, possibly fewer when the round budget runs out)."""
        r, ds = self.cfg.rollout, self.cfg.algorithm.dynamic_sampling
        stats = RolloutStats()
        if not ds.enabled:
            prompts = self.prompts.take(r.prompts_per_step)
            groups = self.generate(prompts, r.group_size, r.temperature, SALT_TRAIN, train=True)
            stats.prompts_drawn, stats.groups_kept, stats.rounds = len(prompts), len(groups), 1
            stats.seconds_generate, stats.seconds_reward = self.last_generate_s, self.last_reward_s
            return groups, stats
        refill: GroupRefill[Sample] = GroupRefill(r.prompts_per_step, max_rounds=ds.max_rounds,
                                                  max_oversample=ds.max_oversample)
        groups: list[list[Sample]] = []
        while not refill.done and not refill.exhausted:
            prompts = self.prompts.take(refill.prompts_to_request())
            groups = self.generate(prompts, r.group_size, r.temperature, SALT_TRAIN, train=True)
            refill.add(groups, [[s.reward for s in g] for g in groups])
            stats.prompts_drawn += len(prompts)
            stats.seconds_generate += self.last_generate_s
            stats.seconds_reward += self.last_reward_s
        stats.rounds = refill.rounds
        batch = refill.take()
        stats.groups_kept = len(batch)
        if not batch:  # no group with a reward signal in the whole budget: train on the last round
            stats.fallback = True   # (zero advantages: the update only moves by the KL/entropy terms)
            batch = groups
        return batch, stats


def reward_metrics(groups: list[list[Sample]], prefix: str = "reward") -> dict[str, float]:
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = np.array([len(s.response_ids) for s in samples], dtype=np.float64)
    flat = [np.std([s.reward for s in g]) == 0 for g in groups if g]
    return {
        f"{prefix}/mean": float(rewards.mean()),
        f"{prefix}/std": float(rewards.std()),
        f"{prefix}/error_frac": float(np.mean([s.reward_error is not None for s in samples])),
        f"{prefix}/zero_std_group_frac": float(np.mean(flat)) if flat else math.nan,
        "response/length_mean": float(lengths.mean()),
        "response/truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
    }
