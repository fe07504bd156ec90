"""`EngineClient` (timeouts, retries, rid-safe retry of /generate, error shapes) and `EngineRouter`
(least outstanding requests, failover to another engine with nothing lost or duplicated, health
checks) against real embedded engines; a scripted HTTP endpoint plays a flaky engine."""

from __future__ import annotations

import asyncio
import importlib.util
import socket

import pytest
from aiohttp import web

from mcore_rl.rollout.engine.driver import EngineDriver
from mcore_rl.rollout.client import EngineClient, EngineHTTPError, EngineUnavailable, expand_samples, request_rids
from mcore_rl.rollout.engine.core import EngineCore
from mcore_rl.rollout.router import EngineRouter, NoHealthyEngine, launch_sglang_router
from mcore_rl.rollout.server import EngineServer, ServerThread
from tests.helpers import throttled


def _engine(port: int = 0) -> ServerThread:
    core = throttled(EngineCore.from_model_path(None, max_running_requests=16, context_length=256, random_seed=0))
    srv = ServerThread(EngineServer(EngineDriver(core)), port=port, shutdown_timeout=0.5)
    srv.start()
    return srv


def _body(i: int, tokens: int = 6) -> dict:
    return {
        "text": f"prompt {i}",
        "rid": f"r{i}",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": tokens, "sampling_seed": i, "ignore_eos": True},
    }


class _Flaky:
    """A scripted /generate: answers the listed statuses in turn, then a fixed result; records
    every call (and every abort) so the retries can be checked."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.calls: list[tuple[str, dict]] = []
        app = web.Application()
        app.add_routes([web.post("/generate", self.generate), web.post("/abort_request", self.abort)])
        self.app = app

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("generate", body))
        if self.statuses:
            status = self.statuses.pop(0)
            return web.json_response({"error": {"message": f"sampling_params.x: scripted {status}"}}, status=status)
        return web.json_response({"text": "ok", "output_ids": [1], "meta_info": {"id": body["rid"]}})

    async def abort(self, request: web.Request) -> web.Response:
        self.calls.append(("abort", await request.json()))
        return web.Response()

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def test_retry_is_rid_safe_and_4xx_is_not_retried() -> None:
    async def go():
        flaky = _Flaky([503, 502])
        async with flaky as url, EngineClient(url, retries=3, backoff=0.01) as c:
            out = await c.generate(text="hi")
            gens = [b for kind, b in flaky.calls if kind == "generate"]
            aborts = [b for kind, b in flaky.calls if kind == "abort"]
            assert len(gens) == 3 and len({g["rid"] for g in gens}) == 1  # the same rid every time
            assert out["meta_info"]["id"] == gens[0]["rid"]
            assert [a["rid"] for a in aborts] == [gens[0]["rid"]] * 2  # aborted before each retry

        flaky = _Flaky([400])
        async with flaky as url, EngineClient(url, retries=3, backoff=0.01) as c:
            with pytest.raises(EngineHTTPError) as err:
                await c.generate(text="hi")
            assert err.value.status == 400 and err.value.message == "sampling_params.x: scripted 400"
            assert len(flaky.calls) == 1

        flaky = _Flaky([503] * 5)
        async with flaky as url, EngineClient(url, retries=2, backoff=0.01) as c:
            with pytest.raises(EngineUnavailable, match="3 attempt"):
                await c.generate(text="hi")

    asyncio.run(go())


def test_unreachable_engine_and_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connection refused

    async def go():
        async with EngineClient(dead, retries=1, backoff=0.01) as c:
            assert await c.health() is False
            with pytest.raises(EngineUnavailable, match="2 attempt"):
                await c.get_model_info()
            with pytest.raises(EngineUnavailable):
                await c.generate(text="x")

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(2)
            return web.json_response({})

        app = web.Application()
        app.add_routes([web.get("/get_model_info", slow)])
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with EngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}", timeout=0.2, retries=0) as c:
                with pytest.raises(EngineUnavailable, match="Timeout"):
                    await c.get_model_info()
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_request_rids_follow_sglang_expansion() -> None:
    assert request_rids({"text": "a", "rid": "x"}) == ["x"]
    assert request_rids({"text": ["a", "b"], "rid": "x"}) == ["x_0", "x_1"]
    assert request_rids(expand_samples({"text": "a", "rid": "x", "sampling_params": {"n": 2}})) == ["x_0", "x_1"]
    assert request_rids({"input_ids": [[1], [2]], "rid": ["p", "q"]}) == ["p", "q"]


def test_router_spreads_load_and_fails_over_without_loss_or_duplicates() -> None:
    a, b = _engine(), _engine()
    try:

        async def go():
            bodies = [_body(i) for i in range(12)] + [_body(i, tokens=200) for i in range(12, 20)]
            async with EngineClient(a.url) as single:
                reference = await asyncio.gather(*(single.generate(body) for body in bodies))
            async with EngineRouter([a.url, b.url], retries=0, health_interval=3600) as router:
                first = await asyncio.gather(*(router.generate(body) for body in bodies[:12]))
                assert router.outstanding == {a.url: 0, b.url: 0}
                # Kill engine b while long requests run on both: b's requests move to a.
                wave = [asyncio.create_task(router.generate(body)) for body in bodies[12:]]
                while b.server.engine.num_requests < 2 or a.server.engine.num_requests < 2:
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(b.stop)
                second = await asyncio.gather(*wave)
                assert b.url not in router.healthy and router.outstanding == {a.url: 0, b.url: 0}
                after = await router.generate(_body(99))
            return reference, first + second, after

        reference, routed, after = asyncio.run(go())
        assert [r["meta_info"]["id"] for r in routed] == [f"r{i}" for i in range(20)]
        for ref, got in zip(reference, routed):
            assert got["output_ids"] == ref["output_ids"]
            lps = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in (got, ref)]
            assert lps[0] == pytest.approx(lps[1], abs=1e-5)
        assert after["meta_info"]["id"] == "r99"
    finally:
        a.stop()


def test_router_least_outstanding_and_health_readmission() -> None:
    a, b = _engine(), _engine()
    port_b = b.port
    try:

        async def go():
            async with EngineRouter([a.url, b.url], retries=0, health_interval=3600) as router:
                picks = []
                for _ in range(4):  # with nothing finishing, picks alternate
                    url = router._pick(set())
                    router.outstanding[url] += 1
                    picks.append(url)
                assert sorted(picks) == sorted([a.url, b.url] * 2)
                router.outstanding = dict.fromkeys(router.outstanding, 0)

                await asyncio.to_thread(b.stop)
                assert await router.check_health() == {a.url: True, b.url: False}
                assert router.healthy == {a.url}
                b2 = await asyncio.to_thread(_engine, port_b)  # the engine comes back on the same address
                try:
                    assert (await router.check_health())[b.url] is True and router.healthy == {a.url, b.url}
                    replies = await router.pause_generation(mode="in_place")
                    assert set(replies) == {a.url, b.url}
                    await router.continue_generation()
                finally:
                    await asyncio.to_thread(b2.stop)
                await asyncio.to_thread(a.stop)
                await router.check_health()
                with pytest.raises(NoHealthyEngine):
                    await router.generate(text="x")

        asyncio.run(go())
    finally:
        a.stop()


def test_sglang_router_is_optional() -> None:
    """Without the package, launching SGLang's router says what to install (EngineRouter needs nothing)."""
    if importlib.util.find_spec("sglang_router") is not None:
        pytest.skip("sglang-router is installed")
    with pytest.raises(RuntimeError, match="pip install sglang-router"):
        launch_sglang_router(["http://127.0.0.1:1"], port=2)


def test_n_samples_are_sent_as_prompts_with_rids_of_their_own() -> None:
    """SGLang gives the samples of `n` ids of its own, so the client asks for them one by one."""
    body = expand_samples(
        {
            "text": ["a", "b"],
            "rid": ["p", "q"],
            "return_logprob": [True, False],
            "sampling_params": {"n": 2, "temperature": 1.0},
        }
    )
    assert body["text"] == ["a", "a", "b", "b"] and body["rid"] == ["p_0", "p_1", "q_0", "q_1"]
    assert body["return_logprob"] == [True, True, False, False]
    assert body["sampling_params"] == [{"temperature": 1.0}] * 4
    assert request_rids(body) == body["rid"]
    # token_ids_logprob: a list per prompt follows its prompt; one list of ids is every prompt's
    ids = {"text": ["a", "b"], "sampling_params": {"n": 2}}
    assert expand_samples({**ids, "token_ids_logprob": [[1], [2, 3]]})["token_ids_logprob"] == [
        [1],
        [1],
        [2, 3],
        [2, 3],
    ]
    assert expand_samples({**ids, "token_ids_logprob": [4, 5]})["token_ids_logprob"] == [4, 5]
    assert expand_samples({"input_ids": [1, 2], "sampling_params": {"n": 3}})["input_ids"] == [[1, 2]] * 3
    plain = {"text": "a", "sampling_params": {"max_new_tokens": 2}}
    assert expand_samples(plain) is plain

    async def go() -> None:
        srv = _engine()
        try:
            async with EngineClient(srv.url) as c:
                out = await c.generate(
                    text=["1+1=", "2+2="],
                    rid=["p", "q"],
                    sampling_params={"n": 2, "max_new_tokens": 3, "temperature": 1.0},
                )
            assert [r["meta_info"]["id"] for r in out] == ["p_0", "p_1", "q_0", "q_1"]
        finally:
            srv.stop()

    asyncio.run(go())
