"""The cluster-scale simulator (benchmarks/simulate_async.py) and its engine model.

The engine model (`ContinuousBatchingEngines`) advances all running requests of an instance one
token per decode step in closed form between events; checked against stepping it token by token.
The tool, on a tiny cluster: the real scheduler with max_staleness > 0 trains faster than with 0
on the same GPUs, never trains a token older than the bound, and accounts for every prompt.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import pytest

from mcore_rl.rollout.pool import GenRequest
from mcore_rl.runtime.simulation import ContinuousBatchingEngines, DecodeModel, ResponseLengths, run_simulated

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    """benchmarks/simulate_async.py as a module (benchmarks/ is not a package)."""
    if "simulate_async" not in sys.modules:
        spec = importlib.util.spec_from_file_location("simulate_async", ROOT / "benchmarks" / "simulate_async.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["simulate_async"]


MODEL = DecodeModel(
    step_fixed_s=5e-3, step_per_seq_s=1e-4, step_per_ctx_token_s=1e-6, prefill_per_token_s=1e-5, slots=4
)


def _token_by_token(reqs: list[tuple[int, int]]) -> list[float]:
    """Finish times of requests (context, tokens) that all arrive at t=0, stepping every token."""
    t = sum(MODEL.prefill_s(c) for c, _ in reqs)
    left = [[c, k] for c, k in reqs]
    done = []
    while any(k > 0 for _, k in left):
        active = [x for x in left if x[1] > 0]
        t += MODEL.step_s(len(active), sum(x[0] for x in active))
        for x in active:
            x[0] += 1
            x[1] -= 1
            if x[1] == 0:
                done.append(t)
    return sorted(done)


@pytest.mark.parametrize("reqs", [[(100, 1000)], [(100, 1000), (2000, 300), (10, 5000)]])
def test_continuous_batching_matches_stepping_token_by_token(reqs):
    async def go():
        engines = ContinuousBatchingEngines(1, MODEL)
        engines.resume(1)
        loop = asyncio.get_running_loop()
        ends = []

        async def one(ctx, k):
            gen = await engines.generate(GenRequest([0] * ctx, {"max_new_tokens": k, "sim_stop_after": k}))
            assert len(gen.output_ids) == k and gen.finish_reason == "stop"
            ends.append(loop.time())

        await asyncio.gather(*(one(c, k) for c, k in reqs))
        return sorted(ends)

    got, want = run_simulated(go()), _token_by_token(reqs)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=2e-3)  # continuous steps: within half a step


def test_pause_ends_requests_with_their_partial_output_and_queued_ones_wait():
    async def go():
        engines = ContinuousBatchingEngines(1, DecodeModel(0.01, 0.0, 0.0, 0.0, slots=1), token_unit=2)
        engines.resume(1)
        first = asyncio.ensure_future(engines.generate(GenRequest([0], {"max_new_tokens": 100})))
        second = asyncio.ensure_future(engines.generate(GenRequest([0], {"max_new_tokens": 10})))
        await asyncio.sleep(0.5)  # 50 real tokens = 25 simulated ones of the first; the second is queued
        engines.pause()
        a = await first
        await asyncio.sleep(1.0)
        engines.resume(2)
        b = await second
        return a, b

    a, b = run_simulated(go())
    assert a.finish_reason == "abort" and len(a.output_ids) == 25 and a.weight_version == 1
    assert b.finish_reason == "length" and len(b.output_ids) == 10 and b.weight_version == 2


def test_response_lengths_are_long_tailed_and_capped():
    lengths = ResponseLengths(median=1000, sigma_prompt=0.6, sigma_sample=0.6, cap=8000)
    mean = lengths.mean(20_000)
    assert 1.2 * 1000 < mean < 1.6 * 1000  # lognormal: mean above the median
    mixed = ResponseLengths(
        median=1000, sigma_prompt=0.0, sigma_sample=0.0, cap=100_000, long_frac=0.25, long_factor=8
    ).mean(20_000)
    assert mixed == pytest.approx(1000 * (0.75 + 0.25 * 8), rel=0.05)


def test_tool_async_beats_sync_within_the_staleness_bound(capsys):
    sim = _tool()
    t0 = time.process_time()  # CPU time: the budget holds on a loaded machine too
    results = sim.main(
        [
            "--total-gpus",
            "32",
            "--trainer-gpus",
            "8",
            "--staleness",
            "0,1,2",
            "--keep",
            "2",
            "--tp",
            "2",
            "--prompts",
            "16",
            "--group",
            "4",
            "--median",
            "600",
            "--cap",
            "4096",
            "--slice",
            "1",
            "--unit",
            "32",
            "--steps",
            "6",
            "--warmup",
            "2",
            "--jobs",
            "1",
        ]
    )
    elapsed = time.process_time() - t0
    out = capsys.readouterr().out
    assert "x sync" in out and "colocated" in out
    by = {(r["label"], r["max_staleness"]): r for r in results}
    sync = by[("8:24", 0)]
    assert sync["staleness_max"] == 0 and sync["dropped_frac"] == 0
    for s in (1, 2):
        r = by[("8:24", s)]
        assert r["tokens_per_s"] >= sync["tokens_per_s"] and r["x_sync"] >= 1.0
        assert 0 < r["staleness_max"] <= s  # overlapped, and never older than the bound
    for r in results:
        assert r["ledger"]["balanced"]
        assert 0 < r["trainer_util"] <= 1 and 0 < r["inference_busy"] <= 1
    assert elapsed < 2.0, elapsed
