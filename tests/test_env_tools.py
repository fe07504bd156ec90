"""Tools for agentic episodes: schema checks, the toolset's answers and guards, the calculator, search,
and the Python tool's persistent sandboxed interpreter (real sandbox processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from mcore_rl.data.tool_calls import ParsedTurn, ToolCall, ToolSpec
from mcore_rl.envs.tools import Tool, ToolError, ToolLimits, Toolset
from mcore_rl.envs.tools.calculator import Calculator, calculate
from mcore_rl.envs.tools.python_tool import PythonSession, PythonTool
from mcore_rl.envs.tools.schema import unsupported, validate
from mcore_rl.envs.tools.search import Search, read_corpus


def turn(*calls: ToolCall, errors: tuple[str, ...] = ()) -> ParsedTurn:
    return ParsedTurn(content="", calls=list(calls), errors=list(errors))


def call(name: str, i: int = 0, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, id=f"call_{i}")


# ------------------------------------------------------------------------------------------ schema

SCHEMA = {
    "type": "object",
    "properties": {
        "mode": {"type": "string", "enum": ["fast", "slow"]},
        "n": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["mode"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("arguments", "errors"),
    [
        ({"mode": "fast", "n": 3, "tags": ["a"]}, []),
        ({"mode": "fast", "n": 3.0}, []),  # an integral float is an integer (JSON has one number type)
        ({}, ["arguments.mode: required"]),
        ({"mode": "medium"}, ["arguments.mode: 'medium' is not one of ['fast', 'slow']"]),
        ({"mode": "fast", "n": True}, ["arguments.n: expected integer, got bool"]),
        ({"mode": "fast", "n": 0}, ["arguments.n: 0 is below 1"]),
        ({"mode": "fast", "tags": ["a", 2]}, ["arguments.tags[1]: expected string, got int"]),
        ({"mode": "fast", "colour": 1}, ["arguments.colour: not a parameter (expected: mode, n, tags)"]),
    ],
)
def test_schema_validation(arguments: dict[str, Any], errors: list[str]) -> None:
    assert validate(arguments, SCHEMA) == errors


def test_unsupported_schema_keywords_are_refused_when_the_toolset_is_built() -> None:
    assert unsupported({"type": "object", "properties": {"x": {"type": "string", "pattern": "a+"}}}) == [
        "parameters.properties.x.pattern"
    ]

    class Patterned(Calculator):
        spec = ToolSpec("calc", parameters={"type": "object", "oneOf": []})

    with pytest.raises(ValueError, match="tool 'calc': schema keywords not checked here: parameters.oneOf"):
        Toolset([Patterned()])


# ------------------------------------------------------------------------------------------ the toolset


class Sleepy(Tool):
    """A tool that ignores its timeout (a hung library call)."""

    spec = ToolSpec("sleepy", parameters={"type": "object", "properties": {}})
    timeout_s = 0.2  # its own timeout; the other tools keep the toolset's
    grace_s = 0.1

    def __init__(self) -> None:
        self.release = threading.Event()

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        self.release.wait(60)
        return "late"


class Buggy(Tool):
    spec = ToolSpec("buggy", parameters={"type": "object", "properties": {}})

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        return {"a": 1}["b"]  # type: ignore[return-value]  # a KeyError: the tool's bug


class Loud(Tool):
    spec = ToolSpec("loud", parameters={"type": "object", "properties": {}})

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        return "x" * 10_000 + "TAIL"


def test_valid_calls_are_answered_in_order_with_their_ids() -> None:
    tools = Toolset([Calculator(), Search()])
    out = tools.run(turn(call("calculator", 0, expression="6*7"), call("search", 1, query="gold atomic number", k=1)))
    assert [m["tool_call_id"] for m in out.messages] == ["call_0", "call_1"]
    assert out.messages[0] == {"role": "tool", "content": "42", "name": "calculator", "tool_call_id": "call_0"}
    assert "atomic number 79" in out.messages[1]["content"]
    assert out.events == {"tool_call": 2} and out.end_reason is None
    assert [s.name for s in tools.specs] == ["calculator", "search"]


def test_invalid_calls_become_messages_and_end_the_episode_at_the_limit() -> None:
    tools = Toolset([Calculator()], ToolLimits(max_consecutive_invalid=3))
    first = tools.run(turn(call("calc", expression="1"), errors=("bad JSON at char 5",)))
    assert [m["content"] for m in first.messages] == [
        "error: the tool call could not be parsed: bad JSON at char 5",
        "error: unknown tool 'calc'; tools: calculator",
    ]
    assert first.events == {"invalid_call": 2} and first.end_reason is None
    # a valid call resets the count of invalid ones in a row
    assert tools.run(turn(call("calculator", expression="1+1"))).messages[0]["content"] == "2"
    second = tools.run(turn(call("calculator", expression=3), call("calculator"), call("calculator", x="1")))
    assert second.events == {"invalid_call": 3} and second.end_reason == "max_invalid_calls"
    assert "arguments.expression: expected string, got int" in second.messages[0]["content"]
    assert "arguments.expression: required" in second.messages[1]["content"]


def test_tool_errors_timeouts_and_long_answers_are_answers() -> None:
    sleepy = Sleepy()
    tools = Toolset([Calculator(), Buggy(), Loud(), sleepy], ToolLimits(timeout_s=30.0, max_response_chars=200))
    try:
        t0 = time.monotonic()
        out = tools.run(
            turn(call("calculator", 0, expression="1/0"), call("buggy", 1), call("loud", 2), call("sleepy", 3))
        )
        assert time.monotonic() - t0 < 10
    finally:
        sleepy.release.set()
    texts = [m["content"] for m in out.messages]
    assert texts[0] == "error: ZeroDivisionError: division by zero"
    assert texts[1] == "error: KeyError: 'b'"
    assert len(texts[2]) <= 200 and texts[2].endswith("TAIL") and "chars cut" in texts[2]
    assert texts[3] == "error: sleepy timed out after 0.2 s"
    assert out.events == {"tool_call": 4, "tool_error": 2, "tool_response_truncated": 1, "tool_timeout": 1}


def test_calls_past_the_per_turn_limit_are_not_run() -> None:
    out = Toolset([Calculator()], ToolLimits(max_calls_per_turn=1)).run(
        turn(call("calculator", 0, expression="1"), call("calculator", 1, expression="2"))
    )
    assert [m["content"] for m in out.messages] == ["1", "error: not run: at most 1 calls per turn"]
    assert out.events == {"tool_call": 1, "tool_call_not_run": 1}


# ------------------------------------------------------------------------------------------ calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [("17 * 23 - sqrt(16)", "387"), ("2^10", "1024"), ("7 // 2 + 7 % 2", "4"), ("-(3)", "-3"), ("1/4", "0.25")],
)
def test_calculator_arithmetic(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "not arithmetic"),
        ("(1).__class__", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("9 ** 9 ** 9", "exponent 387420489 is too large"),
        ("(2 ** 999) ** 999", "more than 4300 digits"),
        ("1 +", "cannot parse"),
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression: str, error: str) -> None:
    with pytest.raises(ToolError, match=error):
        calculate(expression)


# ------------------------------------------------------------------------------------------ search


def test_search_ranks_the_matching_entry_first() -> None:
    search = Search()
    assert search.run({"query": "capital of Canada", "k": 1}, 1.0).startswith("[doc")
    assert "Ottawa" in search.run({"query": "capital of Canada", "k": 1}, 1.0)
    assert search.run({"query": "most massive gas giant"}, 1.0).splitlines()[0].split("] ")[1].startswith("Jupiter")
    with pytest.raises(ToolError, match="no results for 'zzzz'"):
        search.run({"query": "zzzz"}, 1.0)


def test_a_bad_corpus_line_is_named(tmp_path: Any) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"id": 1, "text": "fine"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"{path}:2: not a document"):
        read_corpus(str(path))


# ------------------------------------------------------------------------------------------ python


@pytest.fixture(scope="module")
def python() -> Any:
    tool = PythonTool()
    yield tool
    tool.close()


def run_py(tool: PythonTool, code: str, timeout_s: float = 2.0) -> str:
    try:
        return tool.run({"code": code}, timeout_s)
    except ToolError as exc:
        return f"error: {exc}"


def test_python_keeps_state_across_calls(python: PythonTool) -> None:
    assert run_py(python, "import random\nrandom.seed(3)\nstate = [random.random() for _ in range(3)]") == (
        "(no output)"
    )
    assert run_py(python, "len(state), round(sum(state), 6) > 0") == "(3, True)\n"
    assert run_py(python, "print(undefined_name)").endswith("NameError: name 'undefined_name' is not defined\n")
    assert run_py(python, "state[0] < 1") == "True\n"  # an error keeps the state too


def test_python_timeout_keeps_the_state_and_a_stuck_cell_restarts(python: PythonTool) -> None:
    run_py(python, "kept = 7")
    t0 = time.monotonic()
    assert "ran past 0.5 s and was stopped (variables kept)" in run_py(python, "while True: pass", 0.5)
    assert run_py(python, "kept") == "7\n"
    # a cell that ignores the alarm (as code stuck in C would) is killed: a fresh interpreter
    stuck = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass"
    assert "did not stop; it was restarted and the earlier variables are lost" in run_py(python, stuck, 0.5)
    assert "NameError" in run_py(python, "kept")
    assert "the interpreter died" in run_py(python, "import os\nos._exit(3)")
    assert time.monotonic() - t0 < 20
    # the toolset counts them as a timeout and an error
    tools = Toolset([python], ToolLimits(timeout_s=0.5))
    out = tools.run(turn(call("python", 0, code=stuck), call("python", 1, code="import os; os._exit(1)")))
    assert out.events == {"tool_call": 2, "tool_timeout": 1, "tool_error": 1}


def test_python_runs_in_the_sandbox(python: PythonTool) -> None:
    out = run_py(
        python, "import socket\ntry:\n    socket.socket(socket.AF_INET)\nexcept OSError as e:\n    print('refused')"
    )
    assert out == "refused\n"
    flood = run_py(python, "print('y' * 100_000)")
    assert "more characters of output dropped" in flood and len(flood) < 20_000


def test_an_ended_sandbox_is_restarted_on_the_next_call() -> None:
    """The sandbox ended under the tool (here its conversation closed; its wall time or a crash end it
    the same way): the next call starts a fresh one, runs the cell there and says the state is gone."""
    tool = PythonTool()
    try:
        assert run_py(tool, "a = 1\na") == "1\n"
        tool.session.close()
        assert tool.session.ended.is_set()
        out = run_py(tool, "print('fresh')")
        assert out == "[the interpreter was restarted (exited with status 0); earlier variables are lost]\nfresh\n"
        assert "NameError" in run_py(tool, "a")
    finally:
        tool.close()
    assert tool.session.ended.is_set() and tool.session.result is not None  # close ended the sandbox


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc's children lists)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            for kid in kids:
                if kid not in out:
                    out.add(kid)
                    todo.append(kid)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_interpreter_dies_with_its_owner_killed_by_sigkill() -> None:
    """The episode's owner (a rollout worker) SIGKILLed mid-episode: the sandboxed interpreter goes too."""
    script = (
        "from mcore_rl.envs.tools.python_tool import PythonTool\n"
        "t = PythonTool()\n"
        "print(t.run({'code': 'x = 1\\nx'}, 60.0), flush=True)\n"
        "import time\ntime.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "1\n"
        sandbox = _descendants(owner.pid)
        assert len(sandbox) >= 2  # the bootstrap, the supervisor, the worker
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in sandbox) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in sandbox if _alive(p)]
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_late_reply_is_never_taken_for_the_next_cells() -> None:
    """The caller gave up on a cell (its answer came too late); the next cell gets its own answer."""
    session = PythonSession(startup_s=0.3)
    try:
        assert session.execute("1", 60.0) == {"status": "ok", "output": "1\n"}  # the wait covers the start
        slow = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ntime.sleep(1.5)"
        assert session.execute(slow, 0.2) is None  # the supervisor answers at ~1.2 s: after the caller left
        time.sleep(1.5)
        assert session.execute("2 + 2", 30.0) == {"status": "ok", "output": "4\n"}
    finally:
        session.close()
