"""Spreading rollouts over many engines: least outstanding requests, health checks, failover.

`EngineRouter(urls)` sends each `/generate` to a serving engine with the fewest requests in
flight from this router. When an engine cannot be reached (or answers 5xx), it is marked dead,
told to abort the request's rids (best effort: it may be alive behind a broken connection) and the
request goes to another engine with the same rids; the caller gets exactly one result per request.
A background task re-checks engines that are down (`/health`) and takes them back when they
answer — at once if they report the weight version the pool last delivered, else only after the
next weight update reached them (they wait for weights: an engine that restarted must not serve
old weights). Every engine's state lives in one `EngineStates` (`engine_state.py`); the router,
the pool and the restarter report events to it. Control calls (pause, continue, flush, weight
updates) go to every serving engine, with `control_timeout` rather than the generation timeout.

A streamed request that fails over starts again on the new engine; SGLang's stream events are
cumulative, so the last event is still the whole result.

With many engines in production, SGLang's own router (`sglang-router`, Rust) can stand in front of
them instead: `launch_sglang_router(urls, port)` starts it when the package is installed and every
client then talks to that single URL (it is not installed in this project's environment).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import subprocess
import sys
from typing import Any
from collections.abc import AsyncIterator, Callable, Sequence

from mcore_rl.rollout.client import (
    EngineClient,
    EngineError,
    EngineHTTPError,
    EngineUnavailable,
    expand_samples,
    request_rids,
    with_rids,
)

from mcore_rl.rollout.engine_state import EngineState, EngineStates

logger = logging.getLogger(__name__)


class NoHealthyEngine(EngineUnavailable):
    """No engine could take the call: every one failed, is down, or waits for weights. Fatal for
    a run when it persists (the message says which engines were tried and in what state)."""


class NoEngineToSync(NoHealthyEngine):
    """A weight update found no engine to send to, also after waiting `rollout.no_engine_timeout_s`
    for one to come back. Fatal for a run."""


class EngineRouter:
    """Least-outstanding-requests routing over SGLang-compatible engines."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float = 600.0,
        retries: int = 1,
        health_interval: float = 5.0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        control_timeout: float | None = None,
        weight_update_timeout: float | None = None,
        client_factory: Callable[..., EngineClient] = EngineClient,
    ) -> None:
        """`client_factory`: the client class of the engines' protocol (`EngineClient`: SGLang's;
        `vllm_client.VLLMEngineClient` for vLLM servers), called with a URL and the client options."""
        if not urls:
            raise ValueError("urls: at least one engine URL is needed")
        self.clients = {
            u.rstrip("/"): client_factory(
                u,
                timeout=timeout,
                retries=retries,
                api_key=api_key,
                admin_api_key=admin_api_key,
                control_timeout=control_timeout,
                weight_update_timeout=weight_update_timeout,
            )
            for u in urls
        }
        self.outstanding = {u: 0 for u in self.clients}
        self.states = EngineStates(list(self.clients))
        self.health_interval = health_interval
        self._health_task: asyncio.Task | None = None

    @property
    def healthy(self) -> frozenset[str]:
        """The engines generation goes to (a view of `states`)."""
        return frozenset(self.states.routable())

    @property
    def stale(self) -> frozenset[str]:
        """The engines that answer but wait for the current weights (a view of `states`)."""
        return frozenset(self.states.in_state(EngineState.WAITING))

    async def __aenter__(self) -> EngineRouter:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Start the background health checks (needs a running event loop)."""
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        for c in self.clients.values():
            await c.close()

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, body: dict | None = None, **fields: Any) -> Any:
        """`EngineClient.generate` on the least loaded engine, failing over to the others."""
        body = with_rids(expand_samples({**(body or {}), **fields}))
        tried: set[str] = set()
        while True:
            url = self._pick(tried)
            tried.add(url)
            self.outstanding[url] += 1
            try:
                out = await self.clients[url].generate(body)
                for item in out if isinstance(out, list) else [out]:
                    if isinstance(item, dict) and isinstance(item.get("meta_info"), dict):
                        item["meta_info"].setdefault("engine", url)  # which engine served it (provenance)
                return out
            except EngineUnavailable as err:
                await self._failed(url, body, err)
            except EngineHTTPError as err:
                if err.status < 500:
                    raise  # the request is wrong: another engine would refuse it too
                await self._failed(url, body, err)
            finally:
                self.outstanding[url] -= 1

    async def generate_stream(self, body: dict | None = None, **fields: Any) -> AsyncIterator[dict]:
        body = with_rids(expand_samples({**(body or {}), **fields}))
        tried: set[str] = set()
        while True:
            url = self._pick(tried)
            tried.add(url)
            self.outstanding[url] += 1
            try:
                async for event in self.clients[url].generate_stream(body):
                    yield event
                return
            except EngineUnavailable as err:
                await self._failed(url, body, err)
            except EngineHTTPError as err:
                if err.status < 500:
                    raise
                await self._failed(url, body, err)
            finally:
                self.outstanding[url] -= 1

    # ---- every engine ----------------------------------------------------------------------

    async def broadcast(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call `EngineClient.<method>` on every serving engine concurrently; {url: reply}."""
        urls = sorted(self.states.routable())
        replies = await asyncio.gather(*(getattr(self.clients[u], method)(*args, **kwargs) for u in urls))
        return dict(zip(urls, replies))

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return await self.broadcast("pause_generation", mode)

    async def continue_generation(self) -> dict[str, Any]:
        return await self.broadcast("continue_generation")

    async def flush_cache(self) -> dict[str, Any]:
        return await self.broadcast("flush_cache")

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> dict[str, Any]:
        return await self.broadcast("abort_request", rid, abort_all)

    async def update_weights_from_disk(self, model_path: str, **fields: Any) -> dict[str, Any]:
        return await self.broadcast("update_weights_from_disk", model_path, **fields)

    async def check_health(self) -> dict[str, bool]:
        """Ask every engine's /health now and report it to `states` (an engine that answers again
        with other weights than the pool's waits for the next weight update)."""
        urls = list(self.clients)
        results = await asyncio.gather(*(self.clients[u].health() for u in urls))
        for url, ok in zip(urls, results):
            if not ok:
                self.states.health_failed(url)
            elif self.states.is_down(url):
                self.states.health_ok(url, await self._version_of(url))
        return dict(zip(urls, results))

    async def _version_of(self, url: str) -> str | None:
        try:
            return str(await self.clients[url].get_weight_version())
        except EngineError:
            return None

    # ---- internals -------------------------------------------------------------------------

    def _pick(self, tried: set[str]) -> str:
        candidates = [u for u in self.states.routable() if u not in tried]
        if not candidates:
            raise NoHealthyEngine(f"no serving engine left to try (tried {sorted(tried)}; {self.states.summary()})")
        return min(candidates, key=lambda u: (self.outstanding[u], u))

    async def _failed(self, url: str, body: dict, err: Exception) -> None:
        logger.warning("engine %s failed (%s); retrying elsewhere", url, err)
        self.states.unreachable(url)
        await self.clients[url].abort_quietly(request_rids(body))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_health()
            except Exception:
                logger.exception("health check failed")


def launch_sglang_router(
    urls: Sequence[str], port: int, host: str = "127.0.0.1", policy: str = "cache_aware"
) -> subprocess.Popen:
    """Start SGLang's router (`python -m sglang_router.launch_router`) in front of `urls`; talk to
    it with `EngineClient(f"http://{host}:{port}")`. Needs `pip install sglang-router`."""
    if importlib.util.find_spec("sglang_router") is None:
        raise RuntimeError("sglang_router is not installed (pip install sglang-router); use EngineRouter instead")
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *urls,
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
    ]
    return subprocess.Popen(cmd)
