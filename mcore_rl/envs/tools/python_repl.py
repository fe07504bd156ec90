"""The program the Python tool runs in the sandbox: a supervisor and an interpreter that keeps its state.

Standard library only; never imported by the trainer, its text is the sandbox's `main.py` (see
`python_tool.py`). The supervisor reads one request per line on fd 3 (`{"code", "timeout"}`) and
answers one line (`{"status", "output"}`); the cells run in a forked worker process that keeps one
namespace for the whole episode, as a notebook does:

- the worker stops a cell at its timeout with SIGALRM (state kept; status "timeout");
- a cell that ignores that (stuck in C code) is SIGKILLed by the supervisor one second later, and a
  worker that dies (a crash, `os._exit`, its CPU or memory limit) is replaced by a fresh one: status
  "restarted", the earlier variables are gone, and the answer says so;
- stdout and stderr of a cell are captured (capped at `OUTPUT_CAP` characters, the rest counted); the
  worker's file descriptors 1 and 2 point at /dev/null, so a write past `sys.stdout` is lost rather
  than counted against the sandbox's output cap;
- if the last statement of a cell is an expression, its repr is printed (as in a REPL).

At end-of-file on fd 3 (the episode closed the tool) the supervisor kills the worker and exits.
"""

import ast
import io
import json
import os
import select
import signal
import sys
import traceback
from typing import Any, BinaryIO

OUTPUT_CAP = 16384
HARD_KILL_AFTER_S = 1.0
CHANNEL = 3


class CellTimeout(BaseException):
    """Raised in the cell by SIGALRM (a BaseException: `except Exception` in a cell cannot swallow it)."""


class CappedText(io.TextIOBase):
    def __init__(self, cap: int) -> None:
        self.parts: list[str] = []
        self.size, self.dropped, self.cap = 0, 0, cap

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        room = self.cap - self.size
        if room > 0:
            self.parts.append(text[:room])
            self.size += min(room, len(text))
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def value(self) -> str:
        text = "".join(self.parts)
        if self.dropped:
            text += f"\n[...{self.dropped} more characters of output dropped]"
        return text


def run_cell(code: str, scope: dict[str, Any], timeout: float) -> tuple[str, str]:
    """(status, output) of one cell run in `scope`."""
    out = CappedText(OUTPUT_CAP)
    status = "ok"
    old = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    signal.setitimer(signal.ITIMER_REAL, max(timeout, 0.001))
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last: ast.Expression | None = None
        final = tree.body[-1] if tree.body else None
        if isinstance(final, ast.Expr):
            tree.body.pop()
            last = ast.Expression(final.value)
        exec(compile(tree, "<cell>", "exec"), scope)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), scope)
            if value is not None:
                print(repr(value))
    except CellTimeout:
        status = "timeout"
        print(f"TimeoutError: the cell ran past {timeout:g} s and was stopped (variables kept)")
    except SystemExit:
        status = "error"
        print("SystemExit: exit() ends nothing here; the interpreter keeps running")
    except BaseException:
        status = "error"
        kind, exc, tb = sys.exc_info()
        frames = [f for f in traceback.extract_tb(tb) if f.filename == "<cell>"]
        print("Traceback (most recent call last):", file=out)
        print("".join(traceback.format_list(frames)), end="", file=out)
        print("".join(traceback.format_exception_only(kind, exc)), end="", file=out)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout, sys.stderr = old
    return status, out.value()


def worker(requests: int, replies: int) -> None:
    def alarm(signum: int, frame: Any) -> None:
        raise CellTimeout()

    signal.signal(signal.SIGALRM, alarm)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    scope: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    reader = os.fdopen(requests, "r", encoding="utf-8")
    for line in reader:
        request = json.loads(line)
        status, output = run_cell(request["code"], scope, float(request["timeout"]))
        os.write(replies, (json.dumps({"status": status, "output": output}) + "\n").encode())
    os._exit(0)


def start_worker() -> tuple[int, int, BinaryIO]:
    to_worker_r, to_worker_w = os.pipe()
    from_worker_r, from_worker_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(CHANNEL)
            os.close(to_worker_w)
            os.close(from_worker_r)
            worker(to_worker_r, from_worker_w)
        finally:
            os._exit(1)
    os.close(to_worker_r)
    os.close(from_worker_w)
    return pid, to_worker_w, os.fdopen(from_worker_r, "rb")


def stop_worker(pid: int, to_worker: int, from_worker: BinaryIO) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        os._exit(3)  # signals refused here: end the whole sandbox (the caller starts a fresh one)
    os.waitpid(pid, 0)
    for close in (lambda: os.close(to_worker), from_worker.close):
        try:
            close()
        except OSError:
            pass


def main() -> None:
    channel = os.fdopen(CHANNEL, "rb", buffering=0)
    pid, to_worker, from_worker = start_worker()
    buffered = b""
    while True:
        while b"\n" not in buffered:
            chunk = channel.read(65536)
            if not chunk:
                stop_worker(pid, to_worker, from_worker)
                return
            buffered += chunk
        line, _, buffered = buffered.partition(b"\n")
        request = json.loads(line)
        timeout = float(request["timeout"])
        os.write(to_worker, line + b"\n")
        ready, _, _ = select.select([from_worker], [], [], timeout + HARD_KILL_AFTER_S)
        reply = from_worker.readline() if ready else b""
        if reply:
            os.write(CHANNEL, reply)
            continue
        status, why = ("killed", "ran past its timeout and did not stop") if not ready else ("died", "died")
        stop_worker(pid, to_worker, from_worker)
        pid, to_worker, from_worker = start_worker()
        message = f"the interpreter {why}; it was restarted and the earlier variables are lost"
        os.write(CHANNEL, (json.dumps({"status": status, "output": message}) + "\n").encode())
