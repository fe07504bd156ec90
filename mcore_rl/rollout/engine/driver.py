"""An `EngineCore` driven by one background thread and used from asyncio.

The thread owns the core: adding a request, a continuous-batching step, an abort, a weight update
all run there, in order, between steps. Coroutines hand work over as commands and await futures;
outputs go back to the waiting coroutine's event loop with `call_soon_threadsafe`. The model's
matmuls release the GIL, so an HTTP server on the event loop keeps answering while a step runs.

Pause and weight updates follow SGLang's TokenizerManager:

* `pause(mode)`: new requests are held (accepted, not started) until `resume()`. Mode "abort"
  (SGLang's default) first finishes every in-flight request with finish_reason abort, partial
  output included; "in_place" and "retract" leave them in the engine, not stepping. "retract"
  frees their slots and K/V (`EngineCore.retract`): on resume they are prefilled again, prompt +
  tokens so far, under whatever weights are loaded then; "in_place" keeps slot and K/V, and the
  core recomputes the K/V under the new weights before the next decode step if weights were
  loaded meanwhile (nothing is recomputed otherwise).
* `update_weights(fn)`: if paused, applies at once (paused requests continue on the new weights
  after `resume()`: the caller chose partial rollouts, and `output_token_weight_versions` says
  which weights sampled each token); otherwise new requests are held, in-flight ones run to
  completion, then the weights change and held requests start. So a request that was not paused
  sees one weight version, the one in its `weight_version`.

Aborting a request that has already been paused (in place or retracted) delivers its final output,
partial output included, on `resume()`.

Memory (`release_memory` / `resume_memory`, SGLang's `release_memory_occupation` and
`resume_memory_occupation`): while any memory is released, and after a weights resume until a
weight update completes a sync (`EngineCore.weights_need_reload`: the weights are zero), the engine
cannot generate. A request that would start then is refused at once with `EngineNotReady` (HTTP
503, the message says what brings the engine back), never held: nothing but the caller's own next
call would ever release it. While paused, requests are held as SGLang holds them (a colocated
trainer pauses, releases, trains, resumes and syncs before it continues); if the engine still
cannot generate when generation continues, the held ones are refused then.

No request waits forever: a request held (paused, or waiting for a weight update to find the
engine idle) or paused in the engine is refused (held: `EngineNotReady`; paused in the engine:
finish_reason abort with its partial output) once it has waited `max_hold_s` (default
`MAX_HOLD_S`, the client's default request timeout) for a `resume()` that never came.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import TypeVar
from collections.abc import AsyncIterator, Callable

from mcore_rl.rollout.engine.core import EngineCore, Request, RequestOutput, duplicate_rid

logger = logging.getLogger(__name__)
T = TypeVar("T")
PAUSE_MODES = ("abort", "in_place", "retract")
MAX_HOLD_S = 600.0  # longest a request waits for generation to continue (EngineClient's default timeout)


class EngineDead(RuntimeError):
    """The engine thread stopped (closed, or crashed); nothing more will be served."""


class EngineNotReady(RuntimeError):
    """The engine cannot generate now (memory released, weights zero, or held too long while
    paused); the message says why and what brings it back. HTTP 503."""


class RequestStream:
    """Outputs of one submitted request as an async iterator (the last one has `finished`).

    Closing it before the final output aborts the request, so a client that went away frees its slot.
    """

    def __init__(self, engine: EngineDriver, req: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.req, self.loop = engine, req, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.created = time.monotonic()
        self.held_at: float | None = None  # when it was held (not yet in the core); None = not held
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finished
        return item

    async def result(self) -> RequestOutput:
        """The final output (intermediate streamed ones are skipped)."""
        last = None
        async for out in self:
            last = out
        if last is None:
            raise RuntimeError("the request ended without an output")
        return last

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort_nowait(self.req.rid, "client closed the request")


class EngineDriver:
    """Runs `core` on a daemon thread until `close()`; every method is a coroutine safe to call
    from any event loop (outputs return to the loop that submitted the request)."""

    def __init__(self, core: EngineCore, *, name: str = "mcore-rl-engine", max_hold_s: float = MAX_HOLD_S) -> None:
        if not max_hold_s > 0:
            raise ValueError(f"max_hold_s: must be > 0 seconds, got {max_hold_s!r}")
        self.core = core
        self.max_hold_s = max_hold_s
        self._cv = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        # Engine-thread state (only the engine thread reads or writes these):
        self._streams: dict[str, RequestStream] = {}  # rid -> stream, for requests not yet finished
        self._held: list[RequestStream] = []  # accepted while paused or draining, not in the core yet
        self._when_idle: deque[Callable[[], None]] = deque()  # weight updates waiting for in-flight requests
        self._paused = False
        self._paused_at = 0.0  # time.monotonic() of the last pause
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- state -----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def weight_version(self) -> int | str:
        return self.core.weight_version

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished (held ones included)."""
        return len(self._streams)

    def load(self) -> dict[str, int]:
        """A best-effort snapshot for `/get_load` (read outside the engine thread): requests
        running and waiting (held ones included), tokens in the KV cache and of waiting prompts."""
        core, held = self.core, list(self._held)
        running = core.num_running_reqs
        return {
            "running": running,
            "waiting": max(0, len(self._streams) - running),
            "cached_tokens": core.num_cached_tokens,
            "waiting_tokens": core.num_waiting_tokens + sum(len(s.req.input_ids) for s in held),
        }

    # ---- requests --------------------------------------------------------------------------

    async def submit(self, req: Request) -> RequestStream:
        return (await self.submit_many([req]))[0]

    async def submit_many(self, reqs: list[Request]) -> list[RequestStream]:
        """Add requests atomically (all or none); ValueError naming the field if one is refused."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, r, loop) for r in reqs]

        def add(core: EngineCore) -> None:
            seen: set[str] = set()
            for r in reqs:
                if r.rid in self._streams or r.rid in seen:
                    raise ValueError(duplicate_rid(r.rid))
                seen.add(r.rid)
            if not self._paused:
                reason = core.not_ready_reason()
                if reason is not None:
                    raise EngineNotReady(reason)
            if self._paused or self._when_idle:
                now = time.monotonic()
                for s in streams:
                    s.held_at = now
                self._held.extend(streams)
            else:
                added = []
                try:
                    for r in reqs:
                        core.add_request(r)
                        added.append(r.rid)
                except ValueError:
                    for rid in added:  # their abort outputs find no stream and are dropped
                        core.abort(rid)
                    raise
            for s in streams:
                self._streams[s.req.rid] = s

        try:
            await self.call(add)
        except asyncio.CancelledError:
            for r in reqs:
                self.abort_nowait(r.rid, "client closed the request")
            raise
        return streams

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit and iterate the outputs; leaving the loop early aborts the request."""
        stream = await self.submit(req)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, rid: str, message: str = "Aborted by request") -> None:
        """Finish `rid` with finish_reason abort (unknown or finished rids are ignored, as in SGLang)."""
        await self.call(lambda core: self._abort(rid, message))

    async def abort_all(self, message: str = "Aborted by request") -> int:
        return await self.call(lambda core: self._abort_all(message))

    def abort_nowait(self, rid: str, message: str = "Aborted by request") -> None:
        """Fire-and-forget abort, usable from synchronous cleanup code."""
        self._post(lambda: self._abort(rid, message))

    # ---- control ---------------------------------------------------------------------------

    async def pause(self, mode: str = "abort") -> int:
        """Stop starting and stepping requests; returns how many in-flight requests were paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(PAUSE_MODES)}")

        def pause(core: EngineCore) -> int:
            if mode == "abort":
                self._abort_all("Aborted by pause_generation")
            elif mode == "retract":
                core.retract()
            if not self._paused:
                self._paused_at = time.monotonic()
            self._paused = True
            return core.num_running_reqs + core.num_waiting_reqs

        return await self.call(pause)

    async def resume(self) -> None:
        def resume(core: EngineCore) -> None:
            self._paused = False
            self._release_held()

        await self.call(resume)

    async def release_memory(self, tags: list[str]) -> None:
        """`EngineCore.release_memory` on the engine thread (ValueError unless idle)."""
        await self.call(lambda core: core.release_memory(tags))

    async def resume_memory(self, tags: list[str]) -> None:
        def resume(core: EngineCore) -> None:
            core.resume_memory(tags)
            if not self._paused:
                self._release_held()

        await self.call(resume)

    @property
    def holding(self) -> bool:
        """A new request would not run now (paused: held; memory released or weights zero: refused)."""
        return self._paused or self.core.memory_held

    async def flush_cache(self) -> bool:
        """SGLang's semantics: refused (False) while requests are in flight."""
        return await self.call(lambda core: core.flush_cache())

    async def update_weights(self, fn: Callable[[EngineCore], T]) -> tuple[T, int]:
        """Run `fn(core)` (a weight load, which also sets `core.weight_version`) at a safe point:
        at once if paused, else once the in-flight requests have finished (new ones wait).
        Returns fn's result and how many requests were paused in place across it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def apply() -> None:
            core = self.core
            try:
                _resolve(fut, (fn(core), core.num_running_reqs + core.num_waiting_reqs), None)
            except BaseException as err:
                _resolve(fut, None, err)

        def schedule(core: EngineCore) -> None:
            if self._paused:
                apply()
            else:
                self._when_idle.append(apply)

        await self.call(schedule)
        return await fut

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(core)` on the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDead(f"the engine is not running ({self.error!r})" if self.error else "the engine is closed")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def command() -> None:
            try:
                _resolve(fut, fn(self.core), None)
            except BaseException as err:
                _resolve(fut, None, err)

        self._post(command)
        return await fut

    async def ping(self, timeout: float) -> bool:
        """True if the engine thread answers a no-op command within `timeout` seconds."""
        try:
            await asyncio.wait_for(self.call(lambda core: None), timeout)
            return True
        except (TimeoutError, EngineDead):
            return False

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the engine thread -----------------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def _can_step(self) -> bool:
        core = self.core
        if not core.has_work():
            return False
        # Paused: only deliver finished (aborted) outputs; never decode or admit.
        return not self._paused or (core.num_running_reqs == 0 and core.num_waiting_reqs == 0)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._closed or self._commands or self._can_step() or self._idle_work()):
                        deadline = self._next_deadline()
                        if deadline is not None and deadline <= time.monotonic():
                            break
                        self._cv.wait(None if deadline is None else deadline - time.monotonic())
                    if self._closed:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    command()
                self._expire()
                if self._idle_work():
                    while self._when_idle:
                        self._when_idle.popleft()()
                    if not self._paused:
                        self._release_held()
                if self._can_step():
                    self._step()
        except BaseException as err:
            logger.exception("engine thread crashed")
            self.error = err
        finally:
            with self._cv:
                self._closed = True
                late, self._commands = list(self._commands) + list(self._when_idle), deque()
            for command in late:  # so that no awaiting coroutine hangs
                try:
                    command()
                except Exception:
                    logger.exception("command after the engine stopped")
            dead = EngineDead(f"the engine stopped ({self.error!r})" if self.error else "the engine was closed")
            self._fail(list(self._streams.values()), dead)

    def _next_deadline(self) -> float | None:
        """When the longest-waiting held or paused request has waited `max_hold_s`; None if none waits."""
        starts = [s.held_at for s in self._held if s.held_at is not None]
        if self._paused and (self.core.num_running_reqs or self.core.num_waiting_reqs):
            starts.append(self._paused_at)
        return min(starts) + self.max_hold_s if starts else None

    def _expire(self) -> None:
        """Refuse what has waited `max_hold_s`: held requests (EngineNotReady) and, while paused,
        the requests paused in the engine (finish_reason abort, partial output included)."""
        now = time.monotonic()
        late = [s for s in self._held if s.held_at is not None and now - s.held_at >= self.max_hold_s]
        if late:
            why = (
                "generation is paused (/pause_generation) and did not continue"
                if self._paused
                else "a weight update is waiting for the requests in flight to finish"
            )
            self._fail(late, EngineNotReady(f"held {self.max_hold_s:g} s without starting: {why}"))
        core = self.core
        if (
            self._paused
            and now - self._paused_at >= self.max_hold_s
            and (core.num_running_reqs or core.num_waiting_reqs)
        ):
            core.abort_all(f"paused for {self.max_hold_s:g} s and generation did not continue (/continue_generation)")

    def _idle_work(self) -> bool:
        return bool(self._when_idle) and not self.core.has_work()

    def _step(self) -> None:
        try:
            outs = self.core.step()
        except Exception as err:
            logger.exception("engine step failed; failing the requests in flight")
            failed = [s for s in self._streams.values() if s not in self._held]
            self._fail(failed, RuntimeError(f"engine step failed: {type(err).__name__}: {err}"))
            # Their abort outputs find no stream. If even this fails, the core is broken: the
            # thread ends, every later call gets EngineDead (503) and /health says 503.
            self.core.abort_all("engine step failed")
            return
        self._deliver(outs)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        for out in outs:
            stream = self._streams.get(out.rid)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.rid]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _post_to_loop(loop, items)

    def _fail(self, streams: list[RequestStream], err: BaseException) -> None:
        for s in streams:
            self._streams.pop(s.req.rid, None)
        self._held = [s for s in self._held if s not in streams]
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for s in streams:
            by_loop.setdefault(s.loop, []).append((s, err))
        for loop, items in by_loop.items():
            _post_to_loop(loop, items)

    def _abort(self, rid: str, message: str) -> None:
        held = next((s for s in self._held if s.req.rid == rid), None)
        if held is not None:
            self._held.remove(held)
            self._deliver([_aborted_output(held.req, message, self.core.weight_version)])
        else:
            self.core.abort(rid, message)

    def _abort_all(self, message: str) -> int:
        n = len(self._streams)
        for s in list(self._held):
            self._abort(s.req.rid, message)
        self.core.abort_all(message)
        return n

    def _release_held(self) -> None:
        """Held requests into the core, or refused at once if the engine cannot generate."""
        held, self._held = self._held, []
        reason = self.core.not_ready_reason() if held else None
        if reason is not None:
            self._fail(held, EngineNotReady(reason))
            return
        for s in held:
            s.held_at = None
            try:
                self.core.add_request(s.req)
            except ValueError as err:
                self._fail([s], err)


def _aborted_output(req: Request, message: str, weight_version: int | str) -> RequestOutput:
    """The final output of a request aborted before it reached the engine."""
    return RequestOutput(
        rid=req.rid,
        output_ids=[],
        finished=True,
        finish_reason={"type": "abort", "message": message},
        prompt_tokens=len(req.input_ids),
        completion_tokens=0,
        output_token_logprobs=[],
        output_top_logprobs=[],
        input_token_logprobs=[],
        input_top_logprobs=[],
        weight_version=weight_version,
        output_token_weight_versions=[],
        text="",
    )


def _resolve(fut: asyncio.Future, result: object, err: BaseException | None) -> None:
    def set_() -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(result)

    try:
        fut.get_loop().call_soon_threadsafe(set_)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _post_to_loop(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, object]]) -> None:
    def put() -> None:
        for stream, item in items:
            stream.queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass
