"""The embedded engine's HTTP server, through `EngineClient`: every SGLang endpoint and the OpenAI
ones, streaming, abort and pause, weight updates, bad requests, 200 concurrent requests, and the
`mcore-rl serve` flags. The engine is the real `EngineCore` with the built-in tiny demo model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from mcore_rl.rollout.engine.driver import EngineDriver
from mcore_rl.rollout.client import EngineClient, EngineHTTPError, EngineUnavailable
from mcore_rl.rollout.engine.core import EngineCore
from mcore_rl.rollout.launch_flags import LaunchFlagError, parse_server_args
from mcore_rl.rollout.engine.kv_cache import host_memory_bytes
from mcore_rl.rollout.server import EngineServer, ServerThread, build_server
from mcore_rl.rollout.weight_protocol import encode_named_tensors
from tests.helpers import CONTEXT, LONG, _core, _free_port, _greedy, throttled


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(EngineServer(EngineDriver(_core())))
    srv.start()
    yield srv
    srv.stop()


def run(coro):
    return asyncio.run(coro)


async def _with_client(url: str, fn):
    async with EngineClient(url, retries=0, timeout=120) as c:
        return await fn(c)


async def _running(c: EngineClient, **body) -> asyncio.Task:
    """Start a streaming request and return once its first token has arrived; the task's result
    is the last event."""
    first = asyncio.Event()

    async def consume() -> dict:
        last = None
        async for last in c.generate_stream(**body):
            first.set()
        return last

    task = asyncio.create_task(consume())
    await first.wait()
    return task


# --- info and health ----------------------------------------------------------------------------


def test_health_and_info(server) -> None:
    async def go(c: EngineClient):
        assert await c.health() and await c.health_generate()
        info = await c.get_model_info()
        assert info["is_generation"] is True and info["weight_version"] == "0"
        assert {"model_path", "tokenizer_path", "preferred_sampling_params"} <= set(info)
        sinfo = await c.get_server_info()
        assert sinfo["context_length"] == CONTEXT and sinfo["tp_size"] == 1
        assert sinfo["internal_states"][0]["paused"] is False and "version" in sinfo
        assert await c.get_weight_version() == "0"
        models = json.loads(urllib.request.urlopen(server.url + "/v1/models").read())
        assert models["data"][0]["max_model_len"] == CONTEXT

    run(_with_client(server.url, go))


# --- /generate ----------------------------------------------------------------------------------


def test_generate_shapes_logprobs_and_scoring(server) -> None:
    async def go(c: EngineClient):
        out = await c.generate(
            text="12+34=", sampling_params=_greedy(6), return_logprob=True, top_logprobs_num=3, rid="shape-1"
        )
        meta = out["meta_info"]
        assert meta["id"] == "shape-1" and meta["finish_reason"] == {"type": "length", "length": 6}
        assert meta["prompt_tokens"] == 6 and meta["completion_tokens"] == 6 and len(out["output_ids"]) == 6
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
        assert len(meta["output_top_logprobs"]) == 6 and all(len(t) == 3 for t in meta["output_top_logprobs"])
        # Greedy: the chosen token is the top-1 of the raw distribution.
        assert all(top[0][1] == tok for top, tok in zip(meta["output_top_logprobs"], out["output_ids"]))
        assert meta["input_token_logprobs"] == [[None, ord("="), None]]  # logprob_start_len -1 = last prompt token
        assert isinstance(out["text"], str) and meta["weight_version"] == "0"

        # input_ids, a batch, and `n` parallel samples.
        same = await c.generate(input_ids=list(b"12+34="), sampling_params=_greedy(6))
        assert same["output_ids"] == out["output_ids"]
        batch = await c.generate(text=["a", "bb"], sampling_params=_greedy(2), rid="b")
        assert [r["meta_info"]["id"] for r in batch] == ["b_0", "b_1"]
        par = await c.generate(text="x", sampling_params={"max_new_tokens": 3, "n": 3, "sampling_seed": 5})
        assert len(par) == 3 and len({tuple(r["output_ids"]) for r in par}) == 1  # one seed -> one sample

        # Prompt scoring (teachers, reference models): max_new_tokens 0, log-probs of given tokens.
        ids = list(b"the prompt")
        scored = await c.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            return_text_in_logprobs=True,
        )
        lps = scored["meta_info"]["input_token_logprobs"]
        assert scored["output_ids"] == [] and [t for _, t, _ in lps] == ids and lps[0][0] is None
        assert lps[1][2] == "h" and all(lp < 0 for lp, _, _ in lps[1:])
        assert scored["meta_info"]["input_top_logprobs"][0] is None

    run(_with_client(server.url, go))


def test_stop_token_and_string(server) -> None:
    async def go(c: EngineClient):
        greedy = {"max_new_tokens": 8, "temperature": 0.0}  # no ignore_eos: it also disables stop_token_ids
        free = await c.generate(text="hello", sampling_params=greedy)
        ids = free["output_ids"]
        tok = ids[min(2, len(ids) - 1)]
        stopped = await c.generate(text="hello", sampling_params={**greedy, "stop_token_ids": [tok]})
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
        assert stopped["output_ids"] == ids[: ids.index(tok) + 1]
        # A stop string is trimmed from the text (the tokens stay).
        first_char = free["text"][1:2]
        if first_char and first_char != "\ufffd":
            s = await c.generate(text="hello", sampling_params={**greedy, "stop": first_char})
            assert s["meta_info"]["finish_reason"]["matched"] == first_char and first_char not in s["text"]

    run(_with_client(server.url, go))


def test_streaming_matches_non_streaming(server) -> None:
    async def go(c: EngineClient):
        body = dict(text="stream me", sampling_params={"max_new_tokens": 8, "sampling_seed": 7}, return_logprob=True)
        whole = await c.generate(**body)
        events = [e async for e in c.generate_stream(**body)]
        assert len(events) == 8 and all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
        assert [len(e["output_ids"]) for e in events] == list(range(1, 9))  # cumulative, as SGLang
        last = events[-1]
        assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
        assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
        # A streamed batch tags each event with its item's index.
        indices = {e["index"] async for e in c.generate_stream(text=["a", "b"], sampling_params=_greedy(2))}
        assert indices == {0, 1}

    run(_with_client(server.url, go))


def test_abort_a_streaming_request_and_abort_all(server) -> None:
    async def go(c: EngineClient):
        got = []
        async for event in c.generate_stream(text="abort me", sampling_params=_greedy(LONG), rid="to-abort"):
            got.append(event)
            if len(got) == 3:
                await c.abort_request(rid="to-abort")
        reason = got[-1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and len(got[-1]["output_ids"]) < LONG

        long = [await _running(c, text=f"p{i}", sampling_params=_greedy(LONG)) for i in range(3)]
        await c.abort_request(abort_all=True)
        outs = await asyncio.gather(*long)
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
        assert await c.health_generate()  # and the server goes on

    run(_with_client(server.url, go))


def test_a_client_that_goes_away_frees_its_request(server) -> None:
    """Non-streaming (client timeout) and streaming (client stops reading): the server aborts."""
    engine = server.server.engine

    async def gone() -> float:
        t0 = time.monotonic()
        while engine.num_requests:
            await asyncio.sleep(0.005)
        return time.monotonic() - t0

    async def go(c: EngineClient):
        quick = EngineClient(server.url, retries=0, timeout=0.3)
        with pytest.raises(EngineUnavailable):
            await quick.generate(text="gone", sampling_params=_greedy(LONG))
        await quick.close()
        assert await gone() < 0.5  # far less than LONG decode steps
        async for _ in c.generate_stream(text="gone too", sampling_params=_greedy(LONG)):
            break
        assert await gone() < 0.5

    run(_with_client(server.url, go))


def test_pause_in_place_holds_requests_and_abort_mode_aborts(server) -> None:
    async def go(c: EngineClient):
        recomputed = server.server.core.recomputed_tokens
        running = await _running(c, text="frozen", sampling_params=_greedy(40))
        assert (await c.pause_generation(mode="in_place"))["status"] == "ok"
        held = asyncio.create_task(c.generate(text="wait", sampling_params=_greedy(3)))
        await asyncio.sleep(0.3)
        assert not held.done() and not running.done()
        info = await c.get_server_info()
        assert info["internal_states"][0]["paused"] is True
        assert await c.health_generate()  # paused is still healthy
        with pytest.raises(EngineHTTPError) as err:  # SGLang refuses to flush with requests in flight
            await c.flush_cache()
        assert err.value.status == 400
        await c.continue_generation()
        assert (await held)["meta_info"]["finish_reason"]["type"] == "length"
        resumed = (await running)["meta_info"]
        assert resumed["completion_tokens"] == 40  # resumed where it stopped
        assert resumed["output_token_weight_versions"] == ["0"] * 40
        assert server.server.core.recomputed_tokens == recomputed  # no weight update: nothing recomputed

        running = await _running(c, text="cut", sampling_params=_greedy(LONG))
        await c.pause_generation()  # SGLang's default mode: abort what is in flight
        out = await running
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"]
        await c.continue_generation()

    run(_with_client(server.url, go))


# --- partial rollouts: pause, weight update, continue ---------------------------------------------


def _perturbed(core: EngineCore, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in core.model.named_parameters()]


async def _scored(c: EngineClient, ids: list[int], start: int) -> list[float]:
    """Log-probs of ids[start:] from one fresh prefill (prompt scoring: no K/V of any earlier request)."""
    out = await c.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start - 1
    )
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]


async def _check_against_scoring(c: EngineClient, prompt: list[int], out: dict, old: list, new: list) -> None:
    """The tokens tagged "0" have the log-probs the old weights give the final sequence, those
    tagged "1" those the new weights give it, each from a fresh scoring prefill."""
    versions = out["meta_info"]["output_token_weight_versions"]
    k = versions.count("0")
    assert versions == ["0"] * k + ["1"] * (len(versions) - k) and 0 < k < len(versions), versions
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    full = prompt + out["output_ids"]
    await c.update_weights_from_tensor([encode_named_tensors(old)], weight_version="old")
    under_old = await _scored(c, full, len(prompt))
    await c.update_weights_from_tensor([encode_named_tensors(new)], weight_version="new")
    under_new = await _scored(c, full, len(prompt))
    torch.testing.assert_close(torch.tensor(got[:k]), torch.tensor(under_old[:k]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(got[k:]), torch.tensor(under_new[k:]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_request_paused_across_a_weight_update_continues_on_the_new_weights(mode, stream) -> None:
    """Pause (in_place / retract), update the weights, continue: the request finishes, its tokens
    carry the version that sampled them, and the later ones were computed from K/V of the new
    weights only (their log-probs equal a fresh scoring of the final sequence under them).
    Checked once by hand that this can fail: with `EngineCore._recompute_stale` a no-op the
    in_place cases are off by up to 1.9 nats."""
    core = throttled(EngineCore.from_model_path(None, context_length=CONTEXT, random_seed=0), delay=0.01)
    old = [(n, p.detach().clone()) for n, p in core.model.named_parameters()]
    new = _perturbed(core)
    prompt = list(b"partial rollout: ")
    body = dict(input_ids=prompt, sampling_params=_greedy(30), return_logprob=True)
    with ServerThread(EngineServer(EngineDriver(core))) as srv:

        async def go(c: EngineClient):
            if stream:
                task = await _running(c, **body)
            else:
                task = asyncio.create_task(c.generate(**body))
                while core.num_running_reqs == 0:
                    await asyncio.sleep(0.005)
            assert (await c.pause_generation(mode=mode))["status"] == "ok"
            if mode == "retract":
                assert core.num_running_reqs == 0 and core.num_waiting_reqs == 1 and core.num_cached_tokens == 0
            reply = await c.update_weights_from_tensor([encode_named_tensors(new)], weight_version="1")
            assert reply["success"] and not task.done()
            await c.continue_generation()
            out = await task
            assert out["meta_info"]["completion_tokens"] == 30 and out["meta_info"]["weight_version"] == "1"
            assert len(out["meta_info"]["output_token_weight_versions"]) == 30
            assert core.recomputed_tokens > 0
            await _check_against_scoring(c, prompt, out, old, new)

        run(_with_client(srv.url, go))


def test_a_request_aborted_by_pause_continues_as_a_new_request() -> None:
    """Mode "abort": the request ends with its partial output and log-probs; after the update a
    continuation (prompt + partial output, the remaining tokens) runs wholly on the new weights."""
    core = throttled(EngineCore.from_model_path(None, context_length=CONTEXT, random_seed=0), delay=0.01)
    old = [(n, p.detach().clone()) for n, p in core.model.named_parameters()]
    new = _perturbed(core)
    prompt = list(b"partial rollout: ")
    with ServerThread(EngineServer(EngineDriver(core))) as srv:

        async def go(c: EngineClient):
            task = await _running(c, input_ids=prompt, sampling_params=_greedy(30), return_logprob=True)
            await c.pause_generation(mode="abort")
            first = await task
            meta = first["meta_info"]
            partial = first["output_ids"]
            assert meta["finish_reason"]["type"] == "abort" and 0 < len(partial) < 30
            assert len(meta["output_token_logprobs"]) == len(partial)
            assert meta["output_token_weight_versions"] == ["0"] * len(partial)
            await c.update_weights_from_tensor([encode_named_tensors(new)], weight_version="1")
            await c.continue_generation()
            rest = await c.generate(
                input_ids=prompt + partial, sampling_params=_greedy(30 - len(partial)), return_logprob=True
            )
            assert rest["meta_info"]["output_token_weight_versions"] == ["1"] * (30 - len(partial))
            later = rest["meta_info"]
            joined = {
                "output_ids": partial + rest["output_ids"],
                "meta_info": {
                    "output_token_weight_versions": meta["output_token_weight_versions"]
                    + later["output_token_weight_versions"],
                    "output_token_logprobs": meta["output_token_logprobs"] + later["output_token_logprobs"],
                },
            }
            await _check_against_scoring(c, prompt, joined, old, new)

        run(_with_client(srv.url, go))


def test_flush_cache(server) -> None:
    async def go(c: EngineClient):
        assert "Cache flushed" in await c.flush_cache()

    run(_with_client(server.url, go))


# --- weight updates -----------------------------------------------------------------------------


def test_weight_updates_disk_tensor_version(tmp_path) -> None:
    """Own server: these change the weights."""
    core = _core()
    original = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    with ServerThread(EngineServer(EngineDriver(core))) as srv:

        async def go(c: EngineClient):
            body = dict(text="weights", sampling_params=_greedy(4), return_logprob=True)
            before = await c.generate(**body)
            # Disk: a perturbed copy of the weights, loaded by name; the version is bumped.
            perturbed = {n: t + 0.05 * torch.randn_like(t) for n, t in original.items()}
            save_file(perturbed, str(tmp_path / "model.safetensors"))
            reply = await c.update_weights_from_disk(str(tmp_path), weight_version="5")
            assert reply["success"] is True and reply["num_paused_requests"] == 0
            assert await c.get_weight_version() == "5"
            after = await c.generate(**body)
            assert after["meta_info"]["weight_version"] == "5"
            assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
            # Tensor: the original weights back, in two buckets; the second names the version.
            items = list(original.items())
            half = len(items) // 2
            assert (await c.update_weights_from_tensor([encode_named_tensors(items[:half])], flush_cache=False))[
                "success"
            ]
            assert await c.get_weight_version() == "5"  # a bucket without weight_version leaves it
            await c.update_weights_from_tensor([encode_named_tensors(items[half:])], weight_version="6")
            again = await c.generate(**body)
            assert again["meta_info"]["weight_version"] == "6"
            assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
            # Failures: 400 with SGLang's {"success": false, "message"} naming the problem.
            with pytest.raises(EngineHTTPError) as err:
                await c.update_weights_from_disk(str(tmp_path / "nowhere"))
            assert err.value.status == 400 and "model_path" in err.value.message
            bad = [encode_named_tensors([("model.no_such.weight", torch.zeros(2))])]
            with pytest.raises(EngineHTTPError, match="no_such"):
                await c.update_weights_from_tensor(bad)
            assert (await c.update_weight_version(9))["new_version"] == "9"
            assert await c.get_weight_version() == "9"

        run(_with_client(srv.url, go))


def test_weight_update_waits_for_in_flight_requests(tmp_path) -> None:
    """Not paused: the update waits for running requests (one version per request), as SGLang's
    model-update lock does; new requests wait for the update."""
    core = _core()
    save_file({n: p.detach().clone() for n, p in core.model.named_parameters()}, str(tmp_path / "m.safetensors"))
    with ServerThread(EngineServer(EngineDriver(core))) as srv:

        async def go(c: EngineClient):
            running = await _running(c, text="long", sampling_params=_greedy(LONG))
            update = asyncio.create_task(c.update_weights_from_disk(str(tmp_path)))
            await asyncio.sleep(0.2)
            later = asyncio.create_task(c.generate(text="later", sampling_params=_greedy(2)))
            first = await running
            assert first["meta_info"]["weight_version"] == "0" and first["meta_info"]["completion_tokens"] == LONG
            assert not update.done() or (await update)["success"]
            assert (await update)["success"]
            assert (await later)["meta_info"]["weight_version"] == "1"

        run(_with_client(srv.url, go))


# --- no request waits forever: released, resumed without weights, paused, syncing ------------------


def _post(url: str, path: str, body: dict, timeout: float = 30) -> tuple[int, dict | None, float]:
    """(status, JSON reply, seconds it took) of one raw request: errors are returned, never retried."""
    t0 = time.monotonic()
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    return status, json.loads(raw) if raw else None, time.monotonic() - t0


def test_generate_after_release_and_resume_is_refused_at_once_never_held() -> None:
    """The reported hang: release, resume, /generate waited forever for a weight update nobody
    sends. Now: 503 at once naming what brings the engine back, and served once it is back."""
    core = _core()
    original = [(n, p.detach().clone()) for n, p in core.model.named_parameters()]
    body = {"text": "memory", "sampling_params": _greedy(4), "return_logprob": True}
    with ServerThread(EngineServer(EngineDriver(core))) as srv:
        before = _post(srv.url, "/generate", body)[1]
        assert _post(srv.url, "/release_memory_occupation", {})[0] == 200
        status, err, took = _post(srv.url, "/generate", body)
        assert status == 503 and "memory is released" in err["error"]["message"] and took < 5
        assert _post(srv.url, "/resume_memory_occupation", {})[0] == 200
        status, err, took = _post(srv.url, "/generate", body)
        assert status == 503 and took < 5, (status, err, took)
        assert "weights are zero" in err["error"]["message"] and "update the weights" in err["error"]["message"]
        assert urllib.request.urlopen(srv.url + "/health_generate").status == 200  # alive, just not ready
        reply = _post(
            srv.url,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [encode_named_tensors(original)], "weight_version": "back"},
        )[1]
        assert reply["success"], reply
        status, after, _ = _post(srv.url, "/generate", body)
        assert status == 200 and after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]

        assert _post(srv.url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        status, err, took = _post(srv.url, "/generate", body)
        assert status == 503 and "kv_cache" in err["error"]["message"] and took < 5
        assert _post(srv.url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert _post(srv.url, "/generate", body)[1]["output_ids"] == before["output_ids"]


def test_a_colocated_sleep_holds_requests_until_the_sync_and_continue() -> None:
    """Paused, then released: requests are held (the trainer's own resume, sync and continue
    release them). Continuing while the weights are still zero refuses the held ones at once."""
    core = _core()
    original = [(n, p.detach().clone()) for n, p in core.model.named_parameters()]
    body = {"text": "asleep", "sampling_params": _greedy(3)}
    with ServerThread(EngineServer(EngineDriver(core))) as srv:
        before = _post(srv.url, "/generate", body)[1]
        for path in ("/pause_generation", "/release_memory_occupation"):
            assert _post(srv.url, path, {})[0] == 200
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(_post, srv.url, "/generate", body)
            time.sleep(0.3)
            assert not held.done()  # paused: held, as SGLang holds requests
            assert _post(srv.url, "/resume_memory_occupation", {})[0] == 200
            assert _post(
                srv.url,
                "/update_weights_from_tensor",
                {"serialized_named_tensors": [encode_named_tensors(original)], "weight_version": "1"},
            )[1]["success"]
            assert _post(srv.url, "/continue_generation", {})[0] == 200
            status, out, _ = held.result(30)
            assert status == 200 and out["output_ids"] == before["output_ids"]

            for path in ("/pause_generation", "/release_memory_occupation", "/resume_memory_occupation"):
                assert _post(srv.url, path, {})[0] == 200
            held = pool.submit(_post, srv.url, "/generate", body)
            time.sleep(0.3)
            assert _post(srv.url, "/continue_generation", {})[0] == 200  # no sync came: the weights are zero
            status, err, _ = held.result(30)
            assert status == 503 and "weights are zero" in err["error"]["message"]


def test_paused_requests_are_refused_after_max_hold_s() -> None:
    """Paused with no continue: a held request gets 503 and a request paused in place ends with
    finish_reason abort (its tokens so far) after `max_hold_s`, not never; then the engine serves."""
    with ServerThread(EngineServer(EngineDriver(_core(), max_hold_s=1.0))) as srv:

        async def go(c: EngineClient):
            running = await _running(c, text="frozen", sampling_params=_greedy(LONG))
            await c.pause_generation(mode="in_place")
            t0 = time.monotonic()
            status, err, _ = await asyncio.to_thread(
                _post, srv.url, "/generate", {"text": "x", "sampling_params": _greedy(2)}
            )
            assert status == 503 and "paused" in err["error"]["message"] and "held 1 s" in err["error"]["message"]
            out = await running
            assert time.monotonic() - t0 < 10
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"]
            assert "/continue_generation" in out["meta_info"]["finish_reason"]["message"]
            await c.continue_generation()
            assert (await c.generate(text="y", sampling_params=_greedy(2)))["meta_info"]["completion_tokens"] == 2

        run(_with_client(srv.url, go))


def test_a_request_held_for_a_weight_update_is_refused_after_max_hold_s(tmp_path) -> None:
    """Syncing: an update waits for the request in flight and holds new ones; a held one waits
    `max_hold_s` at most (here less than the running request needs)."""
    core = _core()
    save_file({n: p.detach().clone() for n, p in core.model.named_parameters()}, str(tmp_path / "m.safetensors"))
    with ServerThread(EngineServer(EngineDriver(core, max_hold_s=0.3))) as srv:

        async def go(c: EngineClient):
            running = await _running(c, text="long", sampling_params=_greedy(LONG))
            update = asyncio.create_task(c.update_weights_from_disk(str(tmp_path)))
            await asyncio.sleep(0.1)
            status, err, took = await asyncio.to_thread(
                _post, srv.url, "/generate", {"text": "l", "sampling_params": _greedy(2)}
            )
            assert status == 503 and "weight update" in err["error"]["message"] and took < 5
            assert not running.done()
            assert (await running)["meta_info"]["completion_tokens"] == LONG and (await update)["success"]

        run(_with_client(srv.url, go))


def test_kv_pool_flags_and_max_total_num_tokens() -> None:
    """`--max-total-tokens` sizes the pool and `/get_server_info` reports it (SGLang's field); a
    prompt that can never fit it is a 400 naming the pool, the server goes on serving."""
    args = parse_server_args(["--context-length", "512", "--max-total-tokens", "160", "--device", "cpu"])
    srv = build_server(args)
    assert srv.core.max_total_num_tokens == 160 and srv.core.runner.cache.capacity == 160
    with ServerThread(srv) as st:
        info = json.loads(urllib.request.urlopen(st.url + "/get_server_info").read())
        assert info["max_total_num_tokens"] == 160 and info["max_req_input_len"] == 159
        status, err, _ = _post(st.url, "/generate", {"input_ids": [5] * 200, "sampling_params": _greedy(4)})
        assert status == 400 and "max_total_num_tokens" in err["error"]["message"]
        status, out, _ = _post(st.url, "/generate", {"input_ids": [5] * 150, "sampling_params": _greedy(40)})
        assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}  # clamped
    fraction = build_server(
        parse_server_args(["--context-length", "64", "--mem-fraction-static", "0.01", "--device", "cpu"])
    )
    assert (
        0 < fraction.core.max_total_num_tokens * fraction.core.runner.kv_bytes_per_token <= 0.01 * host_memory_bytes()
    )
    with pytest.raises(ValueError, match="mem_fraction_static"):
        build_server(parse_server_args(["--mem-fraction-static", "1.5", "--device", "cpu"]))


_TRAINER = """
import sys, torch, torch.distributed as dist
from mcore_rl.rollout.weight_protocol import init_custom_process_group
pg = init_custom_process_group("gloo", "127.0.0.1", int(sys.argv[1]), 0, 2, "weight_update_group")
weight = torch.full(tuple(map(int, sys.argv[2:])), 0.01)
dist.broadcast(weight.reshape(-1).view(torch.uint8), group=pg, group_src=0)  # one flattened bucket
# Leave without gloo's destructors: the engine keeps its side of the group until
# /destroy_weights_update_group, and tearing one side down first aborted once (SIGABRT) in CI.
import os; os._exit(0)
"""


@pytest.mark.slow
def test_distributed_weight_update_endpoints() -> None:
    """/init_weights_update_group + /update_weights_from_distributed against a trainer process
    (rank 0 of a gloo group), then /destroy_weights_update_group."""
    core = _core()
    shape = list(core.model.lm_head.weight.shape)
    with ServerThread(EngineServer(EngineDriver(core))) as srv:

        async def go(c: EngineClient):
            port = _free_port()
            trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(port), *map(str, shape)])
            try:
                init = await c.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
                assert init["success"], init
                reply = await c.update_weights_from_distributed(
                    ["lm_head.weight"], ["float32"], [shape], load_format="flattened_bucket", weight_version="3"
                )
                assert reply["success"], reply
                assert trainer.wait(60) == 0
            finally:
                trainer.kill()
            assert torch.all(core.model.lm_head.weight == 0.01) and await c.get_weight_version() == "3"
            assert (await c.destroy_weights_update_group())["success"]
            with pytest.raises(EngineHTTPError, match="group_name"):
                await c.update_weights_from_distributed(["lm_head.weight"], ["float32"], [shape])

        run(_with_client(srv.url, go))


# --- OpenAI -------------------------------------------------------------------------------------


def test_openai_completions_and_chat(server) -> None:
    async def go(c: EngineClient):
        cmpl = await c.completions(
            model="m", prompt=["1+1=", "2+2="], max_tokens=4, temperature=0, n=2, logprobs=2, ignore_eos=True
        )
        assert cmpl["object"] == "text_completion" and len(cmpl["choices"]) == 4
        assert cmpl["choices"][0]["text"] == cmpl["choices"][1]["text"]  # greedy: n copies agree
        lp = cmpl["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4 and all(len(t) <= 2 for t in lp["top_logprobs"])
        assert cmpl["usage"] == {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}
        native = await c.generate(text="1+1=", sampling_params=_greedy(4))
        assert cmpl["choices"][0]["text"] == native["text"]

        chat = await c.chat_completions(
            messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
        )
        msg = chat["choices"][0]
        assert chat["object"] == "chat.completion" and msg["message"]["role"] == "assistant"
        assert len(msg["logprobs"]["content"]) == chat["usage"]["completion_tokens"]
        # The byte tokenizer's chat layout is ChatML.
        prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        ref = await c.generate(
            text=prompt, sampling_params={"max_new_tokens": 3, "temperature": 0, "stop_token_ids": [260]}
        )
        assert msg["message"]["content"] == ref["text"]

        chunks = [
            ch
            async for ch in c.openai_stream(
                "/v1/chat/completions",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                temperature=0,
                stream_options={"include_usage": True},
            )
        ]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["usage"]["completion_tokens"] >= 1
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
        assert text == msg["message"]["content"]
        pieces = [
            ch
            async for ch in c.openai_stream(
                "/v1/completions", prompt="1+1=", max_tokens=4, temperature=0, ignore_eos=True
            )
        ]
        assert "".join(p["choices"][0]["text"] for p in pieces) == cmpl["choices"][0]["text"]

    run(_with_client(server.url, go))


# --- bad requests -------------------------------------------------------------------------------


BAD = [
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "x", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"text": "x", "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty"),  # SGLang's range: [-2, 2]
    ({"text": "x", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "x", "temperature": 0.5}, "temperature"),
    ({"text": "x", "image_data": "cat.png"}, "image_data"),
    ({"input_ids": [1, 2, "3"]}, "input_ids"),
    ({"input_ids": [1, 99999]}, "input_ids"),
    ({"input_ids": [1] * CONTEXT}, "input_ids"),  # over the context length
    ({"text": "x", "input_ids": [1]}, "input_ids"),
    ({"text": "x", "logprob_start_len": 5}, "logprob_start_len"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
]


def test_bad_requests_get_400_naming_the_field_while_others_are_served(server) -> None:
    async def go(c: EngineClient):
        good = [
            asyncio.create_task(
                c.generate(text=f"good {i}", sampling_params={"max_new_tokens": 12, "sampling_seed": i})
            )
            for i in range(6)
        ]
        for body, field in BAD:
            with pytest.raises(EngineHTTPError) as err:
                await c.generate(body)
            assert err.value.status == 400 and field in err.value.message, (body, err.value.message)
        for path, body, field in [
            ("/v1/completions", {"prompt": "x", "max_tokens": -2}, "max_tokens"),
            ("/v1/chat/completions", {"messages": "hi"}, "messages"),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                "tools",
            ),
            ("/pause_generation", {"mode": "later"}, "mode"),
            ("/update_weight_version", {"new_version": ["v2"]}, "new_version"),
        ]:
            with pytest.raises(EngineHTTPError) as err:
                await c._call("POST", path, body, retry=False)
            assert err.value.status == 400 and field in err.value.message, (path, err.value.message)
        req = urllib.request.Request(
            server.url + "/generate", data=b"{not json", headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req)
        assert err.value.code == 400 and "body" in json.loads(err.value.read())["error"]["message"]
        outs = await asyncio.gather(*good)
        assert all(o["meta_info"]["completion_tokens"] >= 1 for o in outs)
        assert await c.health_generate()

    run(_with_client(server.url, go))


def test_rid_in_flight_is_refused(server) -> None:
    async def go(c: EngineClient):
        first = await _running(c, text="one", sampling_params=_greedy(LONG), rid="dup")
        with pytest.raises(EngineHTTPError, match="rid: Duplicate request ID detected: dup"):  # SGLang's wording
            await c.generate(text="two", sampling_params=_greedy(2), rid="dup")
        assert (await first)["meta_info"]["completion_tokens"] == LONG

    run(_with_client(server.url, go))


# --- many concurrent requests -------------------------------------------------------------------


def test_200_concurrent_requests_match_sequential(server) -> None:
    """Nothing lost or duplicated; every result equals the same request run alone (same seed)."""

    def body(i: int) -> dict:
        return dict(
            text=f"request {i}: " + "ab" * (i % 7),
            rid=f"c{i}",
            return_logprob=True,
            sampling_params={"max_new_tokens": 4 + i % 5, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 1000 + i},
        )

    async def go(c: EngineClient):
        t0 = time.monotonic()
        together = await asyncio.gather(*(c.generate(body(i)) for i in range(200)))
        t_together = time.monotonic() - t0
        alone = [await c.generate(body(i)) for i in range(200)]
        return together, alone, t_together

    together, alone, _ = run(_with_client(server.url, go))
    assert sorted(o["meta_info"]["id"] for o in together) == sorted(f"c{i}" for i in range(200))
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a["meta_info"]["id"] == f"c{i}"
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"], i
        lp_a = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lp_b = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert lp_a == pytest.approx(lp_b, abs=1e-5)


# --- launch flags -------------------------------------------------------------------------------


def test_launch_flags(monkeypatch) -> None:
    args = parse_server_args(
        [
            "--model-path",
            "/m",
            "--port",
            "31000",
            "--dtype",
            "bfloat16",
            "--quantization",
            "fp8",
            "--context-length",
            "512",
            "--random-seed",
            "3",
            "--mem-fraction-static",
            "0.8",
            "--tp-size",
            "1",
            "--max-running-requests",
            "16",
        ]
    )
    assert args.engine_kwargs() == {
        "dtype": "bfloat16",
        "quantization": "fp8",
        "random_seed": 3,
        "context_length": 512,
        "max_running_requests": 16,
        "load_format": "auto",
        "return_original_logprob": True,
        "logprobs_mode": "raw",
        "sampling_mask_max_tokens": 16384,
    }
    processed = parse_server_args(["--logprobs-mode", "processed", "--sampling-mask-max-tokens", "99"]).engine_kwargs()
    assert processed["logprobs_mode"] == "processed" and processed["sampling_mask_max_tokens"] == 99
    with pytest.raises(LaunchFlagError, match="--sampling-mask-max-tokens 0"):
        parse_server_args(["--sampling-mask-max-tokens", "0"])
    dummy = parse_server_args(["--load-format", "dummy", "--device", "cpu"]).engine_kwargs()
    assert dummy["load_format"] == "dummy" and dummy["device"] == "cpu"
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")  # SGLang's switch: temperature-scaled log-probs
    assert parse_server_args([]).engine_kwargs()["return_original_logprob"] is False
    assert args.port == 31000 and args.mem_fraction_static == 0.8
    assert parse_server_args([]).model_path is None and parse_server_args(["--model", "/x"]).model_path == "/x"
    for argv, needle in [
        (["--tp-size", "2"], "--tp-size 2"),
        (["--quantization", "awq"], "--quantization awq"),
        (["--enable-lora"], "--enable-lora"),
        (["--speculative-algorithm=EAGLE"], "--speculative-algorithm"),
        (["--port", "x"], "--port"),
        (["--load-format", "pt"], "--load-format"),
    ]:
        with pytest.raises(LaunchFlagError, match=needle):
            parse_server_args(argv)


@pytest.mark.slow
def test_mcore_rl_serve_command() -> None:
    """`mcore-rl serve` with no --model-path serves the demo model; bad flags exit 2 with a message."""
    bad = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "serve", "--tp-size", "4"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--tp-size 4" in bad.stderr
    port = _free_port()
    sglang_knobs = [
        "--cuda-graph-max-bs-decode",
        "8",
        "--stream-output",
        "--mem-fraction-static",
        "0.7",
    ]  # start, not refuse
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.cli", "serve", "--port", str(port), "--context-length", "64", *sglang_knobs],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        req = urllib.request.Request(
            url + "/generate", data=json.dumps({"text": "hi", "sampling_params": _greedy(3)}).encode()
        )
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert out["meta_info"]["completion_tokens"] == 3
        info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=60).read())
        assert info["ignored_flags"] == {"--cuda-graph-max-bs-decode": ["8"]} and info["incremental_streaming_output"]
    finally:
        proc.terminate()
        proc.wait(30)
