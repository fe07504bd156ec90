"""Sampling-mask replay, engine side: the sampler's support and processed log-probs, the engine's
`return_sampling_mask` / `logprobs_mode`, SGLang's wire fields over HTTP, and both pools."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from mcore_rl.rollout.client import EngineClient, EngineHTTPError
from mcore_rl.rollout.engine.core import EngineCore, Request
from mcore_rl.rollout.engine.driver import EngineDriver
from mcore_rl.rollout.engine.sampling import BatchSampling, SamplingParams, sample, sample_with_support
from mcore_rl.rollout.pool import EmbeddedEnginePool, GenRequest, HTTPEnginePool, check_logprobs_mode
from mcore_rl.rollout.server import EngineServer, ServerThread
from tests.helpers import TOK, make_engine, run, tiny_model


def _support_by_definition(logits: torch.Tensor, sp: SamplingParams) -> set[int]:
    """S from SGLang's rules written out per row: temperature softmax, keep the top_k most likely,
    the smallest prefix of the sorted probabilities whose mass before it is <= top_p, and p >= min_p·max."""
    p = torch.softmax(logits.double() / sp.temperature, -1)
    order = p.argsort(descending=True).tolist()
    keep, before = set(), 0.0
    for rank, i in enumerate(order):
        if sp.top_k != -1 and rank >= sp.top_k:
            break
        if sp.top_p < 1 and before > sp.top_p:
            break
        if p[i] < p[order[0]] * sp.min_p:
            break
        keep.add(i)
        before += float(p[i])
    return keep


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.5, top_k=20, min_p=0.05),
    ],
)
def test_sampler_support_and_processed_logprob(sp: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    ctl = BatchSampling.of([sp] * 64, 50, torch.device("cpu"))
    u = torch.rand(64, generator=g, dtype=torch.float64)
    drawn = sample_with_support(logits, ctl, u)
    assert torch.equal(drawn.tokens, sample(logits, ctl, u))  # the same draw as without the mask
    for r in range(64):
        s = drawn.support(r)
        assert s == sorted(s) and int(drawn.tokens[r]) in s and len(s) == int(drawn.sizes[r])
        want = _support_by_definition(logits[r], sp)
        assert set(s) == want, (r, sorted(want), s)
        p = torch.softmax(logits[r].double() / sp.temperature, -1)
        want_lp = math.log(float(p[int(drawn.tokens[r])] / p[s].sum()))
        assert abs(float(drawn.logprobs[r]) - want_lp) < 1e-6


def test_sampler_greedy_rows_are_singletons() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=4), SamplingParams(top_k=1)]
    ctl = BatchSampling.of(params, 20, torch.device("cpu"))
    drawn = sample_with_support(logits, ctl, torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64))
    for r in (0, 2):
        assert drawn.support(r) == [int(logits[r].argmax())] and float(drawn.logprobs[r]) == 0.0
    assert len(drawn.support(1)) == 4
    all_greedy = BatchSampling.of([params[0]] * 2, 20, torch.device("cpu"))
    d = sample_with_support(logits[:2], all_greedy, None)
    assert [d.support(r) for r in range(2)] == [[int(x)] for x in logits[:2].argmax(-1)]


def _mask_req(rid: str, prompt: str, **sp) -> Request:
    sp.setdefault("max_new_tokens", 12)
    sp.setdefault("ignore_eos", True)
    return Request(rid, TOK.encode(prompt), SamplingParams(**sp), return_logprob=True, return_sampling_mask=True)


def test_engine_mask_fields_tokens_unchanged_and_logprobs_modes() -> None:
    model = tiny_model()
    plain = run(
        make_engine(model, return_original_logprob=False),
        [
            Request(
                "a",
                TOK.encode("hello"),
                SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.8, seed=3),
                return_logprob=True,
            )
        ],
    )["a"]
    raw_engine = make_engine(model, return_original_logprob=False)  # raw = full-vocab log_softmax(logits / T)
    out = run(
        raw_engine,
        [
            _mask_req("a", "hello", temperature=0.9, top_p=0.8, seed=3),
            _mask_req("g", "the fox", temperature=0.0),
            _mask_req("k", "1+1=", temperature=1.2, top_k=7, seed=5),
        ],
    )
    a = out["a"]
    assert a.output_ids == plain.output_ids  # asking for the mask changes no token
    # raw log-probs, as without the mask (batch mates move fp32 rounding only)
    assert [lp for lp, _ in a.output_token_logprobs] == pytest.approx(
        [lp for lp, _ in plain.output_token_logprobs], abs=1e-5
    )
    assert len(a.output_token_sampling_mask) == len(a.output_ids) == len(a.output_token_sampling_logprobs)
    for tok, s, lp, (raw, _) in zip(
        a.output_ids, a.output_token_sampling_mask, a.output_token_sampling_logprobs, a.output_token_logprobs
    ):
        assert tok in s and lp <= 0 and lp >= raw - 1e-6  # renormalising over S raises the log-prob
    assert all(s == [t] for s, t in zip(out["g"].output_token_sampling_mask, out["g"].output_ids))
    assert out["g"].output_token_sampling_logprobs == [0.0] * 12
    assert all(len(s) == 7 for s in out["k"].output_token_sampling_mask)
    # processed mode: output_token_logprobs are the processed ones, the tokens are the same
    proc = run(
        make_engine(model, logprobs_mode="processed"), [_mask_req("a", "hello", temperature=0.9, top_p=0.8, seed=3)]
    )["a"]
    assert proc.output_ids == a.output_ids
    assert [lp for lp, _ in proc.output_token_logprobs] == pytest.approx(a.output_token_sampling_logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="logprobs_mode"):
        make_engine(model, logprobs_mode="scaled")


def test_engine_refuses_unbounded_and_capped_supports_and_keeps_lists_across_retract() -> None:
    engine = make_engine(tiny_model(), sampling_mask_max_tokens=8)
    with pytest.raises(ValueError, match="return_sampling_mask: the support would be the whole vocabulary"):
        engine.add_request(_mask_req("u", "hi", temperature=1.0))
    with pytest.raises(ValueError, match="top_k=9 exceeds the engine's sampling_mask_max_tokens=8"):
        engine.add_request(_mask_req("c", "hi", temperature=1.0, top_k=9))
    with pytest.raises(ValueError, match="return_sampling_mask: expected a boolean"):
        engine.add_request(Request("b", [1, 2], SamplingParams(top_k=2), return_sampling_mask="yes"))
    # a top-p support larger than the cap finishes the request (abort naming the cap), lists consistent
    out = run(engine, [_mask_req("p", "hi", temperature=5.0, top_p=0.99)])["p"]
    assert out.finish_reason["type"] == "abort" and "--sampling-mask-max-tokens" in out.finish_reason["message"]
    assert len(out.output_token_sampling_mask) == len(out.output_ids)
    # retract mid-generation: the per-token lists carry on with the tokens
    engine = make_engine(tiny_model())
    engine.add_request(_mask_req("r", "hello", temperature=0.9, top_k=10, seed=1, max_new_tokens=10))
    for _ in range(4):
        engine.step()
    assert engine.retract() == 1
    final = [o for _ in range(20) for o in engine.step() if o.finished]
    solo = run(
        make_engine(tiny_model()), [_mask_req("r", "hello", temperature=0.9, top_k=10, seed=1, max_new_tokens=10)]
    )["r"]
    assert final[0].output_ids == solo.output_ids
    assert final[0].output_token_sampling_mask == solo.output_token_sampling_mask
    assert len(final[0].output_token_sampling_logprobs) == 10


@pytest.fixture(scope="module")
def server():
    core = EngineCore(tiny_model(), TOK, context_length=256, logprobs_mode="processed", sampling_mask_max_tokens=64)
    srv = ServerThread(EngineServer(EngineDriver(core)))
    srv.start()
    yield srv
    srv.stop()


def test_http_fields_errors_and_pools(server) -> None:
    async def go(c: EngineClient):
        info = await c.get_server_info()
        body = dict(
            input_ids=TOK.encode("hello"),
            return_sampling_mask=True,
            return_logprob=True,
            sampling_params={
                "max_new_tokens": 6,
                "temperature": 0.8,
                "top_p": 0.9,
                "top_k": 40,
                "ignore_eos": True,
                "sampling_seed": 4,
            },
        )
        out = await c.generate(**body)
        batch = await c.generate(
            input_ids=[TOK.encode("a"), TOK.encode("b")],
            return_sampling_mask=[True, False],
            sampling_params={"max_new_tokens": 3, "top_k": 3},
        )
        errors = []
        for bad in (
            {"return_sampling_mask": 1, "sampling_params": {"top_k": 3}},
            {"return_sampling_mask": True, "sampling_params": {"temperature": 1.0}},
            {"return_sampling_mask": True, "sampling_params": {"top_k": 65}},
        ):
            with pytest.raises(EngineHTTPError) as err:
                await c.generate(input_ids=[1, 2, 3], **bad)
            errors.append((err.value.status, err.value.message))
        return info, out, batch, errors

    async def main():
        async with EngineClient(server.url, retries=0, timeout=60) as c:
            return await go(c)

    info, out, batch, errors = asyncio.run(main())
    assert info["logprobs_mode"] == "processed" and info["sampling_mask_max_tokens"] == 64
    meta = out["meta_info"]
    assert meta["output_token_sampling_mask_length"] == 6 == len(meta["output_token_sampling_mask"])
    for tok, s in zip(out["output_ids"], meta["output_token_sampling_mask"]):
        assert tok in s
    assert [t[0] for t in meta["output_token_logprobs"]] == meta["output_token_sampling_logprobs"]
    assert "output_token_sampling_mask" in batch[0]["meta_info"]
    assert "output_token_sampling_mask" not in batch[1]["meta_info"]
    assert [s for s, _ in errors] == [400, 400, 400]
    assert all("return_sampling_mask" in m for _, m in errors), errors
    assert "whole vocabulary" in errors[1][1] and "--sampling-mask-max-tokens=64" in errors[2][1]

    # the HTTP pool (the path a real SGLang URL takes) and the embedded pool give the same Generation
    pool = HTTPEnginePool([server.url], timeout=60)
    try:
        req = GenRequest(
            TOK.encode("hello"),
            {
                "max_new_tokens": 6,
                "temperature": 0.8,
                "top_p": 0.9,
                "top_k": 40,
                "ignore_eos": True,
                "sampling_seed": 4,
            },
            return_sampling_mask=True,
        )
        done: list[int] = []  # progress: one call per finished generation, as it finishes
        gen = pool.generate([req], on_done=lambda: done.append(1))[0]
        assert len(done) == 1
        with pytest.raises(ValueError, match="rollout.sampling_mask_replay: engine .* logprobs_mode='processed'"):
            check_logprobs_mode(pool, type("R", (), {"sampling_mask_replay": False})())
        check_logprobs_mode(pool, type("R", (), {"sampling_mask_replay": True})())
    finally:
        pool.close()
    assert gen.output_ids == out["output_ids"]
    assert gen.output_sampling_masks == meta["output_token_sampling_mask"]
    assert gen.output_sampling_logprobs == meta["output_token_sampling_logprobs"] == gen.output_logprobs
    emb = EmbeddedEnginePool([EngineCore(server.server.engine.core.model, TOK, context_length=256)])
    done.clear()
    g2 = emb.generate([req], on_done=lambda: done.append(1))[0]
    assert len(done) == 1
    assert g2.output_ids == gen.output_ids and g2.output_sampling_masks == gen.output_sampling_masks
    assert g2.output_sampling_logprobs == pytest.approx(gen.output_sampling_logprobs, abs=1e-9)


def test_config_validation_and_the_engines_the_trainer_builds() -> None:
    from mcore_rl.rollout.pool import build_engine_pool
    from tests.helpers import rl, rl_errors

    errs = rl_errors(rl("rollout.sampling_mask_replay=true"))
    assert any(e.startswith("rollout.sampling_mask_replay:") and "top_p == 1 and top_k == -1" in e for e in errs), errs
    errs = rl_errors(rl("rollout.sampling_mask_replay=true", "rollout.top_p=0.9", "rollout.temperature=0"))
    assert any(e.startswith("rollout.sampling_mask_replay:") and "temperature > 0" in e for e in errs), errs
    errs = rl_errors(rl("rollout.sampling_mask_replay=true", "rollout.top_k=20", "distill.top_k=4"))
    assert any(e.startswith("rollout.sampling_mask_replay:") and "distill.top_k=4" in e for e in errs), errs
    from mcore_rl.config.rl_validate import validate_rl_config

    ok = rl("rollout.sampling_mask_replay=true", "rollout.top_p=0.9")
    validate_rl_config(ok, 2)
    for cfg, mode in ((ok, "processed"), (rl(), "raw")):
        pool = build_engine_pool(cfg.rollout, cfg.model, TOK, 0)
        assert [c.logprobs_mode for c in pool.cores] == [mode]


def test_partial_rollouts_concatenate_supports_in_token_order() -> None:
    """Async partial rollouts (a request cut by weight syncs, continued as prompt + tokens so far):
    the sample's flat supports follow its tokens across the parts, and μ is the processed log-prob."""
    from mcore_rl.runtime.scheduler import RolloutScheduler, SchedulerConfig
    from mcore_rl.runtime.simulation import SimBackend, SimulatedEngines, run_simulated, simulate_learner

    class MaskBackend(SimBackend):
        async def generate(self, request):
            gen = await super().generate(request)
            first = len(request.input_ids) - 1  # the prompt is one token: response index of this part's first token
            gen.output_sampling_masks = [[first + k] for k in range(len(gen.output_ids))]
            gen.output_sampling_logprobs = [-0.25] * len(gen.output_ids)
            return gen

    async def go():
        eng = SimulatedEngines(2, 16, lambda batch: 0.01 * (1 + batch / 16))
        sch = RolloutScheduler(
            MaskBackend(eng, base_tokens=16), SchedulerConfig(group_size=4, batch_groups=4, max_staleness=2)
        )
        return await simulate_learner(sch, eng, 8, lambda g: 1.0, sync_time=0.05, keep_batches=True)

    run = run_simulated(go())
    samples = [s for groups in run.batches for g in groups for s in g]
    assert any(s.token_versions is not None for s in samples)  # some were continued across a sync
    for s in samples:
        assert s.sampling_mask_ids == list(range(len(s.response_ids)))
        assert s.sampling_mask_counts == [1] * len(s.response_ids) and s.rollout_logp == [-0.25] * len(s.response_ids)
