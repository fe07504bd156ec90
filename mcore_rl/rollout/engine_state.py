"""One state per engine, and every change of it in one class: the pool's single view of its engines.

    STARTING  its process was (re)started and does not answer yet
    SERVING   it holds the pool's weights and takes generation requests
    WAITING   it answers, but with other weights: restarted (dummy weights), back with an old
              version, or its last weight update did not finish or did not match the trainer's
              checksum (`mixed`: it may hold a mix of two versions under the old version's name)
    SYNCING   it is paused for a weight update
    DEAD      it cannot be reached

The router routes generation to SERVING engines and to SYNCING ones that were serving when the
update began (a request sent to a paused engine waits there and runs with the new weights). A
weight update goes to SERVING and WAITING engines. The events, from whoever observes them — the
router's failover and health checks, the pool's fan-out and weight updates, the restarter — are
the methods below:

    event               from                      to
    unreachable         SERVING, WAITING, SYNCING DEAD   (a STARTING engine is expected not to answer)
    process_restarted   any                       STARTING (`mixed` cleared: a fresh process)
    process_ready       STARTING                  SERVING if it reports the expected version and
    health_ok           DEAD, STARTING              is not `mixed`, else WAITING
    sync_begin          SERVING, WAITING          SYNCING
    delivered           WAITING (outside a sync)  SERVING;  SYNCING: marked confirmed
    sync_end            SYNCING                   SERVING if confirmed, else WAITING + `mixed`
                        DEAD                      DEAD + `mixed`;  STARTING: unchanged (a new process)

`tests/test_engine_state.py` checks the class against this table. `mixed` survives a death (an engine reached again over the network still holds
what it held) and is cleared only by a confirmed weight update or a fresh process.

Thread-safe: the pool's event-loop thread, the trainer's thread and the restarter call it.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from collections.abc import Sequence

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    WAITING = "waiting_for_weights"
    SYNCING = "syncing"
    DEAD = "dead"


S = EngineState


@dataclass
class EngineRecord:
    state: EngineState = EngineState.SERVING
    mixed: bool = False  # a weight update to it failed: only a confirmed one takes it back
    routed_while_syncing: bool = False  # was serving when the current update paused it
    confirmed: bool = False  # got, and confirmed, the whole current update


class EngineStates:
    """The state of each engine of a pool (by URL), changed only through its events."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._engines = {u: EngineRecord() for u in urls}
        self.expected_version: str | None = None  # the weight version the pool last delivered
        self._lock = threading.RLock()

    # ---- queries ----------------------------------------------------------------------------

    def state(self, url: str) -> EngineState:
        return self._engines[url].state

    def mixed(self, url: str) -> bool:
        return self._engines[url].mixed

    def in_state(self, *states: EngineState) -> list[str]:
        with self._lock:
            return [u for u, e in self._engines.items() if e.state in states]

    def routable(self) -> list[str]:
        """Engines that take generation requests."""
        with self._lock:
            return [
                u
                for u, e in self._engines.items()
                if e.state is S.SERVING or (e.state is S.SYNCING and e.routed_while_syncing)
            ]

    def update_targets(self) -> list[str]:
        """Engines a weight update goes to: the serving ones and those that wait for weights."""
        return self.in_state(S.SERVING, S.WAITING)

    def needs_weights(self) -> bool:
        """No engine serves, and some wait for weights: only a weight sync lets generation go on."""
        with self._lock:
            return not self.routable() and bool(self.in_state(S.WAITING))

    def summary(self) -> str:
        with self._lock:
            return ", ".join(f"{u}: {e.state.value}{' (mixed)' if e.mixed else ''}" for u, e in self._engines.items())

    # ---- events -----------------------------------------------------------------------------

    def unreachable(self, url: str) -> None:
        """A call to it failed to connect or timed out; a starting engine stays starting."""
        with self._lock:
            e = self._engines[url]
            if e.state in (S.SERVING, S.WAITING, S.SYNCING):
                e.state = S.DEAD

    def process_restarted(self, url: str) -> None:
        """Its process died and a new one was launched at the same URL (dummy weights)."""
        with self._lock:
            e = self._engines[url]
            e.state, e.mixed, e.routed_while_syncing, e.confirmed = S.STARTING, False, False, False

    def process_ready(self, url: str, version: str | None) -> None:
        """A restarted process answers `/health`, reporting weight version `version`."""
        with self._lock:
            if self._engines[url].state is S.STARTING:
                self._answered(url, version)

    def health_ok(self, url: str, version: str | None) -> None:
        """`/health` answered (with `version`, asked only for engines that were down)."""
        with self._lock:
            if self._engines[url].state in (S.DEAD, S.STARTING):
                self._answered(url, version)

    def health_failed(self, url: str) -> None:
        self.unreachable(url)

    def is_down(self, url: str) -> bool:
        """Dead or starting: a health check that succeeds needs the engine's weight version."""
        return self._engines[url].state in (S.DEAD, S.STARTING)

    def sync_begin(self, urls: Sequence[str]) -> None:
        """`urls` were paused for a weight update."""
        with self._lock:
            for u in urls:
                e = self._engines[u]
                if e.state in (S.SERVING, S.WAITING):
                    e.routed_while_syncing = e.state is S.SERVING
                    e.state, e.confirmed = S.SYNCING, False

    def delivered(self, url: str, version: str) -> bool:
        """`url` got and confirmed every tensor of `version`; False if it is no longer reachable."""
        with self._lock:
            e = self._engines[url]
            if e.state is S.SYNCING:
                e.confirmed = True
            elif e.state in (S.SERVING, S.WAITING):
                if e.state is S.WAITING:
                    logger.warning("engine %s has the current weights (version %s) and serves again", url, version)
                e.state, e.mixed = S.SERVING, False
            else:
                return False
            self.expected_version = version
            return True

    def sync_end(self, urls: Sequence[str]) -> list[str]:
        """The update of `urls` is over: those that confirmed it serve (returned: they must be told
        to continue); the others may hold a mix of two versions and wait for the next one."""
        resume = []
        with self._lock:
            for u in urls:
                e = self._engines[u]
                if e.state is S.SYNCING and e.confirmed:
                    e.state, e.mixed = S.SERVING, False
                    resume.append(u)
                    continue
                if e.state is S.STARTING:
                    continue  # restarted meanwhile: the new process holds none of the update
                e.mixed = True
                if e.state is S.SYNCING:
                    e.state = S.WAITING
                logger.warning(
                    "engine %s did not get (or did not confirm) the whole weight update; it stays paused "
                    "and out of routing until a later update reaches it",
                    u,
                )
                e.routed_while_syncing = e.confirmed = False
            for u in resume:
                self._engines[u].routed_while_syncing = self._engines[u].confirmed = False
        return resume

    # ---- internals --------------------------------------------------------------------------

    def _answered(self, url: str, version: str | None) -> None:
        e = self._engines[url]
        if not e.mixed and (self.expected_version is None or version == self.expected_version):
            logger.warning("engine %s is healthy again", url)
            e.state = S.SERVING
        else:
            logger.warning("engine %s is back with other weights; it serves again after the next weight update", url)
            e.state = S.WAITING
