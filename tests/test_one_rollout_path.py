"""The one rollout path: the scheduler's two schedules, on a virtual clock (`runtime/simulation.py`).

The synchronous schedule (`SchedulerConfig.rounds`, max_staleness 0) draws each batch in rounds of
groups submitted together and refills what the filter dropped (DAPO's dynamic sampling: the keep
rate seen so far sets the next round's size, within `max_oversample`; after `max_rounds` the last
round is trained unfiltered). The streaming schedule runs the same group and batch steps: a second
source's first samples of each group, the group steps of a round (here a round of one group) and
the batch steps at hand-out, and samples that are old by design do not make their group stale.
The real engines and recipes on both schedules: tests/test_recipes_polaris.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import pytest

from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.runtime.scheduler import RolloutScheduler, SchedulerConfig
from mcore_rl.runtime.simulation import SimBackend, SimulatedEngines, run_simulated

G = 2


def _engines() -> SimulatedEngines:
    return SimulatedEngines(2, 16, lambda batch: 0.01)


class _Scripted(SimBackend):
    """Group k's rewards are mixed when k is in `mixed`, else constant."""

    mixed: frozenset[int] = frozenset()

    async def score(self, samples: list[Sample]) -> None:
        for j, s in enumerate(samples):
            s.reward = float(j == 0) if s.prompt.index in self.mixed else 0.0


def _batches(backend: SimBackend, cfg: SchedulerConfig, steps: int) -> tuple[list, RolloutScheduler]:
    async def go():
        backend.engines.resume(1)
        sch = RolloutScheduler(backend, cfg)
        sch.start()
        out = []
        for k in range(steps):
            got = await sch.next_batch(k + 1)
            assert got is not None
            out.append(got)
            backend.engines.pause()
            backend.engines.resume(k + 2)
            await sch.step_done(k + 2)
        await sch.close()
        return out, sch

    return run_simulated(go())


def test_rounds_refill_by_the_keep_rate_and_drop_the_surplus():
    be = _Scripted(_engines(), base_tokens=4, filter_constant=True)
    be.mixed = frozenset({1, 3, 4, 5})
    cfg = SchedulerConfig(group_size=G, batch_groups=3, rounds=True, max_rounds=5, max_oversample=4.0)
    [(groups, m)], sch = _batches(be, cfg, 1)
    # round 1: 3 prompts, 1 kept (keep rate 1/3); round 2: ceil(2 / (1/3)) = 6 prompts (3..8), 3 kept
    assert [g[0].prompt.index for g in groups] == [1, 3, 4]
    assert (m["rollout/rounds"], m["rollout/prompts_drawn"], m["rollout/groups_kept"]) == (2.0, 9.0, 3.0)
    assert m["rollout/dynamic_sampling_fallback"] == 0.0
    report = sch.ledger.report(sch.pending(), G)
    assert report["balanced"] and report["trained"] == 3
    assert report["filtered_reasons"] == {"constant_reward": 5, "surplus": 1}  # prompt 5 was kept beyond the batch


def test_rounds_fall_back_to_the_last_round_when_nothing_passes():
    be = _Scripted(_engines(), base_tokens=4, filter_constant=True)
    cfg = SchedulerConfig(group_size=G, batch_groups=3, rounds=True, max_rounds=2, max_oversample=4.0)
    [(groups, m)], sch = _batches(be, cfg, 1)
    # keep rate 0: the second round asks for 3 x max_oversample = 12 prompts; all constant
    assert [g[0].prompt.index for g in groups] == list(range(3, 15))
    assert (m["rollout/rounds"], m["rollout/groups_kept"], m["rollout/dynamic_sampling_fallback"]) == (2.0, 0.0, 1.0)
    report = sch.ledger.report(sch.pending(), G)
    assert report["balanced"] and report["trained"] == 12 and report["filtered_reasons"] == {"constant_reward": 3}


def test_rounds_need_max_staleness_zero():
    with pytest.raises(ValueError, match="max_staleness 0"):
        SchedulerConfig(group_size=G, batch_groups=3, max_staleness=1, rounds=True)


class _Steps(SimBackend):
    """A second source writes each group's first sample; the group step replaces every group's
    last sample by an old one (version -5, as a rescued rollout is); the batch step counts."""

    exempt: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rounds: list[int] = []
        self.finished: list[int] = []

    def co_count(self, prompt: Prompt, group_size: int) -> int:
        return 1

    async def co_generate(self, prompt: Prompt, count: int) -> list[Sample]:
        v = self.engines.version  # the policy's version: the batch trains at it
        return [Sample(prompt, prompt.index, [1], [-1.0], v, "stop", "x", "second@0", source="second")] * count

    async def repair(self, groups: list[list[Sample]]) -> list[list[Sample]]:
        self.rounds.append(len(groups))
        return [g[:-1] + [replace(g[-1], policy_version=-5, source="old")] for g in groups]

    def finish(self, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, float]]:
        self.finished.append(len(groups))
        return groups, {"steps/finished_groups": float(len(groups))}

    def stale_ok(self, sample: Sample) -> bool:
        return self.exempt and sample.source == "old"


@pytest.mark.parametrize("rounds", [True, False])
def test_group_and_batch_steps_in_both_schedules(rounds):
    be = _Steps(_engines(), base_tokens=4)
    s = 0 if rounds else 1
    cfg = SchedulerConfig(group_size=3, batch_groups=4, max_staleness=s, rounds=rounds)
    got, sch = _batches(be, cfg, 3)
    for groups, m in got:
        assert m["steps/finished_groups"] == 4.0 and len(groups) == 4
        for g in groups:
            assert [x.source for x in g] == ["second", "policy", "old"]  # the second source's first sample
    assert be.finished == [4, 4, 4]
    # rounds: one group step per batch of 4; streaming: one per group as it finishes
    assert set(be.rounds) == ({4} if rounds else {1})
    assert sch.ledger.dropped_stale == 0  # the old samples do not make their groups stale


def test_without_the_exemption_old_samples_make_their_group_stale():
    be = _Steps(_engines(), base_tokens=4)
    be.exempt = False
    cfg = SchedulerConfig(group_size=3, batch_groups=4, max_staleness=1, stale_policy="drop")

    async def go():
        be.engines.resume(1)
        sch = RolloutScheduler(be, cfg)
        sch.start()
        with contextlib.suppress(TimeoutError):  # every group holds a sample of version -5: never a batch
            await asyncio.wait_for(sch.next_batch(1), 2.0)
        dropped = sch.ledger.dropped_stale
        await sch.close()
        return dropped

    assert run_simulated(go()) > 0 and be.finished == []


class _ResetsInfo(SimBackend):
    """Scores as the real rewards do: `info` is set anew for every scored sample."""

    async def score(self, samples: list[Sample]) -> None:
        for s in samples:
            s.info, s.reward = {}, float(len(s.response_ids) % 2)


def test_regenerations_survive_scoring_and_stay_capped():
    """A group regenerated because it came out too stale keeps its count through scoring (which
    sets `info` anew), so it is dropped after `max_regenerations` instead of being sent forever."""
    be = _ResetsInfo(_engines(), base_tokens=4)
    cfg = SchedulerConfig(group_size=2, batch_groups=2, max_staleness=1, stale_policy="regenerate", max_regenerations=2)

    async def go():
        be.engines.resume(1)
        sch = RolloutScheduler(be, cfg)
        sch.start()
        with contextlib.suppress(TimeoutError):  # the trainer is 99 versions ahead: every group is too stale
            await asyncio.wait_for(sch.next_batch(100), 3.0)
        counts = sch.ledger.regenerated_stale, sch.ledger.dropped_stale
        await sch.close()
        return counts

    regenerated, dropped = run_simulated(go())
    assert dropped > 0 and regenerated <= cfg.max_regenerations * (dropped + cfg.buffer_groups)
