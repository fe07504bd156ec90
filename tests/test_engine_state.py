"""`EngineStates`, the one owner of every engine's state, as a table: each event from each state,
the state it leads to, and the flags (`mixed`, routed, update target) the pool's decisions read.
The faults behind the events (kill, SIGSTOP, restart, a half-finished sync, a checksum mismatch)
are exercised with real processes in tests/test_engine_faults.py and test_engine_processes.py."""

from __future__ import annotations

import pytest

from mcore_rl.rollout.engine_state import EngineState, EngineStates

S = EngineState
URL = "http://e"


def _in(
    state: EngineState, *, mixed: bool = False, routed_while_syncing: bool = True, expected: str | None = "3"
) -> EngineStates:
    """An engine put into `state` through events only."""
    st = EngineStates([URL])
    if expected is not None:
        st.delivered(URL, expected)
    if mixed:  # a sync that did not finish
        st.sync_begin([URL])
        st.sync_end([URL])
    if state is S.SERVING:
        assert not mixed
    elif state is S.WAITING:
        if not mixed:
            st.unreachable(URL)
            st.health_ok(URL, "0")  # back with other weights
    elif state is S.SYNCING:
        if not routed_while_syncing and not mixed:
            st.unreachable(URL)
            st.health_ok(URL, "0")
        st.sync_begin([URL])
    elif state is S.DEAD:
        st.unreachable(URL)
    elif state is S.STARTING:
        st.process_restarted(URL)
    assert st.state(URL) is state and st.mixed(URL) == (mixed and state is not S.STARTING)
    return st


# (state before, mixed before, event, its arguments) -> (state after, mixed after)
TABLE = [
    # an engine killed (SIGKILL) or frozen (SIGSTOP: a call times out) is dead, whatever it did
    (S.SERVING, False, "unreachable", (), S.DEAD, False),
    (S.WAITING, False, "unreachable", (), S.DEAD, False),
    (S.SYNCING, False, "unreachable", (), S.DEAD, False),
    (S.WAITING, True, "unreachable", (), S.DEAD, True),  # what it held is still suspect
    (S.STARTING, False, "unreachable", (), S.STARTING, False),  # a starting engine does not answer yet
    (S.DEAD, False, "health_failed", (), S.DEAD, False),
    (S.SERVING, False, "health_failed", (), S.DEAD, False),
    # restart: whatever it was, a fresh process with dummy weights
    (S.SERVING, False, "process_restarted", (), S.STARTING, False),
    (S.DEAD, True, "process_restarted", (), S.STARTING, False),
    (S.SYNCING, False, "process_restarted", (), S.STARTING, False),
    (S.STARTING, False, "process_ready", ("0",), S.WAITING, False),  # dummy weights: waits for ours
    (S.STARTING, False, "process_ready", ("3",), S.SERVING, False),
    (S.SERVING, False, "process_ready", ("0",), S.SERVING, False),  # not restarting: nothing to do
    # back after a death (SIGCONT, network): serves only with the pool's weights, never when mixed
    (S.DEAD, False, "health_ok", ("3",), S.SERVING, False),
    (S.DEAD, False, "health_ok", ("2",), S.WAITING, False),
    (S.DEAD, True, "health_ok", ("3",), S.WAITING, True),
    (S.STARTING, False, "health_ok", ("0",), S.WAITING, False),
    (S.WAITING, False, "health_ok", ("3",), S.WAITING, False),  # only a weight update takes it back
    (S.SERVING, False, "health_ok", ("2",), S.SERVING, False),
    # weight updates
    (S.SERVING, False, "sync_begin", (), S.SYNCING, False),
    (S.WAITING, True, "sync_begin", (), S.SYNCING, True),
    (S.DEAD, False, "sync_begin", (), S.DEAD, False),
    (S.STARTING, False, "sync_begin", (), S.STARTING, False),
    (S.WAITING, True, "delivered", ("4",), S.SERVING, False),
    (S.DEAD, False, "delivered", ("4",), S.DEAD, False),  # not reachable: not confirmed
    (S.SYNCING, False, "delivered", ("4",), S.SYNCING, False),  # confirmed; serves at sync_end
    (S.SYNCING, False, "sync_end", (), S.WAITING, True),  # half-finished sync / checksum mismatch
    (S.DEAD, False, "sync_end", (), S.DEAD, True),  # killed mid-sync
    (S.STARTING, False, "sync_end", (), S.STARTING, False),  # killed mid-sync and already restarted
]


@pytest.mark.parametrize("before, mixed, event, args, after, mixed_after", TABLE)
def test_every_transition(before, mixed, event, args, after, mixed_after) -> None:
    st = _in(before, mixed=mixed)
    getattr(st, event)(*([[URL]] if event in ("sync_begin", "sync_end") else [URL]), *args)
    assert (st.state(URL), st.mixed(URL)) == (after, mixed_after)


def test_a_confirmed_update_resumes_the_engine_and_sets_the_expected_version() -> None:
    st = _in(S.WAITING, mixed=True)
    st.sync_begin([URL])
    assert URL not in st.routable()  # it was not serving: no request goes to it while it loads
    assert st.delivered(URL, "4") and st.expected_version == "4"
    assert st.sync_end([URL]) == [URL] and st.state(URL) is S.SERVING and not st.mixed(URL)


def test_what_the_pool_reads_in_each_state() -> None:
    rows = {  # state: (routed, update target)
        S.SERVING: (True, True),
        S.WAITING: (False, True),
        S.DEAD: (False, False),
        S.STARTING: (False, False),
    }
    for state, (routed, target) in rows.items():
        st = _in(state)
        assert (URL in st.routable(), URL in st.update_targets()) == (routed, target), state
    # a paused engine that was serving still takes requests (they wait in it for the new weights)
    assert URL in _in(S.SYNCING).routable() and URL not in _in(S.SYNCING).update_targets()
    assert URL not in _in(S.SYNCING, routed_while_syncing=False).routable()


def test_needs_weights_and_the_summary() -> None:
    st = EngineStates(["a", "b"])
    assert not st.needs_weights()
    st.delivered("a", "1")
    st.unreachable("a")
    st.process_restarted("b")
    assert not st.needs_weights() and st.summary() == "a: dead, b: starting"
    st.process_ready("b", "0")
    assert st.needs_weights() and st.in_state(S.WAITING) == ["b"]
    with pytest.raises(KeyError):
        st.state("c")
