"""The Python tool: code run in the sandbox (`mcore_rl/rewards/sandbox.py`), its state kept across the
calls of one episode.

One sandboxed interpreter per episode, not a replay of earlier cells: a sandbox costs 0.2-1 s to start
on the development machine (measured with `run_python("print(1+1)")`, loaded machine), so replaying
every earlier cell in a fresh sandbox would cost a start per call and re-run every cell's work (and
its randomness, time and files would differ on replay). The interpreter (`python_repl.py`) starts in
the background when the tool is built, answers one cell per call over the sandbox's conversation
channel, and dies at `close()` (the episode's end): its process, the sandbox's namespaces and its
files go with it. A cell that runs past the call's timeout is stopped with its state kept, or, stuck
in C code, the interpreter is replaced and the answer says the variables are lost. If the sandbox
itself ends (its wall time `session_s`, a crash of the supervisor), the next call starts a new one
and says so.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import replace
from functools import cache
from typing import Any

from mcore_rl.data.tool_calls import ToolSpec
from mcore_rl.envs.tools.toolset import Tool, ToolError, ToolTimeout
from mcore_rl.rewards.sandbox import Channel, Limits, SandboxResult, run_python

STARTUP_S = 30.0  # the most a call waits for a sandbox to start, on top of its timeout
SESSION_LIMITS = Limits(cpu_s=60.0, wall_s=900.0, memory_mb=512, results_bytes=1 << 20)


@cache
def repl_source() -> str:
    with open(os.path.join(os.path.dirname(__file__), "python_repl.py"), encoding="utf-8") as f:
        return f.read() + "\nmain()\n"


class PythonSession:
    """One sandboxed interpreter: `execute(code, timeout_s)` -> {"status", "output"}, or None when the
    sandbox has ended (its `result` says how)."""

    def __init__(self, limits: Limits = SESSION_LIMITS, isolation: str = "auto", startup_s: float = STARTUP_S) -> None:
        self.startup_s = startup_s
        self.requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        # (request id, reply): a reply that comes after its caller gave up is told apart by its id
        self.replies: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue()
        self.sent = 0
        self.result: SandboxResult | None = None
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(limits, isolation), name="python-tool", daemon=True)
        self.thread.start()

    def _serve(self, limits: Limits, isolation: str) -> None:
        try:
            self.result = run_python(repl_source(), limits=limits, isolation=isolation, converse=self._converse)
        except Exception as exc:  # the sandbox could not even be launched: the calls say so
            self.result = SandboxResult(status="setup_error", error=f"{type(exc).__name__}: {exc}")
        finally:
            self.ended.set()
            self.replies.put(None)

    def _converse(self, channel: Channel) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                return
            number = request.pop("id")
            if not channel.send(json.dumps(request).encode() + b"\n"):
                return
            line = channel.receive()
            if line is None:
                return
            try:
                self.replies.put((number, json.loads(line)))
            except json.JSONDecodeError:
                return

    def execute(self, code: str, timeout_s: float) -> dict[str, Any] | None:
        """The cell's reply, or None: the sandbox ended, or gave no answer by `timeout_s + startup_s`."""
        if self.ended.is_set():
            return None
        self.sent += 1
        self.requests.put({"id": self.sent, "code": code, "timeout": timeout_s})
        deadline = time.monotonic() + timeout_s + self.startup_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self.replies.get(timeout=left)
            except queue.Empty:
                return None
            if item is None:
                return None
            if item[0] == self.sent:
                return item[1]
        return None

    def close(self, wait_s: float = 10.0) -> None:
        self.requests.put(None)
        self.thread.join(wait_s)


class PythonTool(Tool):
    spec = ToolSpec(
        name="python",
        description="Run Python code; variables persist between calls. Print what you want to see.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 1}},
            "required": ["code"],
            "additionalProperties": False,
        },
    )

    def __init__(
        self, limits: Limits = SESSION_LIMITS, isolation: str = "auto", timeout_s: float | None = None
    ) -> None:
        self.limits, self.isolation, self.timeout_s = limits, isolation, timeout_s
        self.session = PythonSession(limits, isolation)  # starts now, in the background
        self.lock = threading.Lock()

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        with self.lock:
            reply = self.session.execute(arguments["code"], timeout_s)
            note = ""
            if reply is None:  # the sandbox ended: start a fresh one and run the cell there
                why = self._why_ended()
                self.session.close(0.0)
                self.session = PythonSession(self.limits, self.isolation)
                reply = self.session.execute(arguments["code"], timeout_s)
                if reply is None:
                    raise ToolError(f"the Python sandbox is unavailable: {self._why_ended()}")
                note = f"[the interpreter was restarted ({why}); earlier variables are lost]\n"
        output = note + str(reply.get("output", ""))
        if reply.get("status") in ("timeout", "killed"):
            raise ToolTimeout(output.strip())
        if reply.get("status") == "died":
            raise ToolError(output.strip())
        return output if output.strip() else "(no output)"

    def _why_ended(self) -> str:
        r = self.session.result
        if r is None:
            return "no answer"
        return r.error or (r.status if r.status != "exited" else f"exited with status {r.returncode}")

    def close(self) -> None:
        self.session.close()


def python_limits(memory_mb: int = 512, cpu_s: float = 60.0, session_s: float = 900.0) -> Limits:
    """The sandbox limits of one episode's interpreter (memory per process, CPU of one interpreter)."""
    return replace(SESSION_LIMITS, memory_mb=memory_mb, cpu_s=cpu_s, wall_s=session_s)
