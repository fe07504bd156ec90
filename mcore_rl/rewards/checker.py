"""Code tests judged where the program cannot reach them (docs/sandbox.md, "Checked runs").

The candidate program runs alone in the sandbox (`mcore_rl/rewards/candidate.py` is its
`main.py`); it never holds the tests, the verdict or anything that reports one. The tests run
here, in the calling process (the reward worker), in a namespace where each name the tests take
from the program (`f`, HumanEval's entry point) is a proxy: calling it sends the arguments to the
sandbox as plain data and returns the candidate's answer rebuilt as plain data
(`candidate.from_wire`: exact built-in types only, so no object of the program's ever runs here).
The comparisons (`assert f(2) == 5`) therefore run on our objects with our builtins; each test is
run and counted once, so the score is at most the number of tests. A run that does not end
cleanly — timeout, memory, output flood, a crash, an exit before the tests are done, a killed
sandbox supervisor, a broken reply — scores 0: only a run that answered every call and exited
normally is scored.

Limits (documented in docs/sandbox.md): the tests may pass and receive plain data only (a test
that needs the candidate's own objects — an instance, a generator, a function it returns — sees
a `TypeError`: the test fails); a mutation of an argument by the candidate is not seen here; the
tests are trusted code (from the dataset, not the policy) and run unsandboxed in this process.
"""

from __future__ import annotations

import builtins
import dis
import functools
import marshal
from dataclasses import dataclass, field
from types import CodeType
from typing import Any
from collections.abc import Mapping, Sequence

from mcore_rl.rewards import candidate
from mcore_rl.rewards.candidate import WireError, dumps, from_wire, loads, to_wire
from mcore_rl.rewards.sandbox import Channel, Limits, SandboxResult, run_python


class CandidateError(Exception):
    """The candidate raised an exception that is not one of Python's built-in ones, returned
    something that is not plain data, or could not be called with the test's arguments."""


class RunLost(BaseException):
    """The sandboxed run ended or broke the protocol: no further call can be answered.
    (A BaseException: a test's `except Exception` must not carry on past it.)"""


@dataclass
class CodeOutcome:
    passed: int
    total: int
    kind: str  # "pass" or a failure kind (mcore_rl/rewards/code.py)
    detail: str = ""
    sandbox: SandboxResult | None = field(default=None, repr=False)

    def reward(self, mode: str = "fraction") -> float:
        if self.total == 0:
            return 0.0
        if mode == "all":
            return 1.0 if self.passed == self.total else 0.0
        return min(self.passed, self.total) / self.total


@functools.lru_cache(maxsize=1)
def _candidate_code() -> str:
    """`candidate.py` compiled once, as marshal data in hex (the sandbox runs this interpreter, so
    the format matches; compiling it in every run cost about 3 ms of CPU)."""
    with open(candidate.__file__, encoding="utf-8") as f:
        return marshal.dumps(compile(f.read(), "candidate.py", "exec")).hex()


def candidate_main(program: str) -> str:
    """The sandbox's main.py: `candidate.py`, then serving `program`."""
    return f"import marshal\nexec(marshal.loads(bytes.fromhex({_candidate_code()!r})))\nserve({program!r})\n"


@functools.lru_cache(maxsize=1024)
def _compiled(context: str, tests: tuple[str, ...]) -> tuple[CodeType, list[CodeType], frozenset[str]]:
    """The context and tests compiled, and the names they expect from elsewhere (tasks repeat)."""
    try:
        compiled = [compile(t, f"test_{i}.py", "exec") for i, t in enumerate(tests)]
        context_code = compile(context, "context.py", "exec")
    except SyntaxError as exc:
        raise ValueError(f"code reward: a test does not compile: {exc}") from None
    return context_code, compiled, frozenset(free_names([context_code, *compiled]))


def free_names(codes: Sequence[CodeType]) -> set[str]:
    """Global names the code reads but never binds at module level (what it expects from elsewhere)."""
    loaded: set[str] = set()
    stored: set[str] = set()

    def walk(code: CodeType, top: bool) -> None:
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_NAME", "LOAD_GLOBAL"):
                loaded.add(ins.argval)
            elif ins.opname == "STORE_GLOBAL" or (top and ins.opname == "STORE_NAME"):
                stored.add(ins.argval)
        for const in code.co_consts:
            if isinstance(const, CodeType):
                walk(const, False)

    for code in codes:
        walk(code, True)
    return loaded - stored


# exceptions that steer iteration: StopIteration out of `f` inside `all(map(f, xs))` would end the
# iteration early and pass the test
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


def _exception(reply: Mapping[str, Any]) -> Exception:
    """The candidate's exception as one of ours: the built-in class of that name, else CandidateError."""
    name, message = str(reply.get("raised")), str(reply.get("message", ""))
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _CONTROL_FLOW):
        try:
            return cls(message)
        except Exception:
            pass
    return CandidateError(f"{name}: {message}")


class _Session:
    """One request, one reply, in turn; the first broken reply loses the run."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.last_id = 0
        self.lost: str | None = None

    def lose(self, why: str) -> RunLost:
        self.lost = self.lost or why
        return RunLost(self.lost)

    def first(self) -> dict[str, Any]:
        line = self.channel.receive()
        if line is None:
            raise self.lose("the run ended before the program loaded")
        try:
            return loads(line)
        except WireError as exc:
            raise self.lose(f"a broken message: {exc}") from None

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.lost:
            raise RunLost(self.lost)
        self.last_id += 1
        message["id"] = self.last_id
        if not self.channel.send(dumps(message)):
            raise self.lose("the run ended")
        line = self.channel.receive()
        if line is None:
            raise self.lose("the run ended before it answered")
        try:
            reply = loads(line)
        except WireError as exc:
            raise self.lose(f"a broken reply: {exc}") from None
        if reply.get("id") != self.last_id:
            raise self.lose("a reply out of turn")
        return reply

    def call(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            sent = {"args": to_wire(list(args)), "kwargs": to_wire(dict(kwargs))}
        except WireError as exc:
            raise CandidateError(f"the test passes {exc} (only plain data crosses the sandbox)") from None
        reply = self.request({"op": "call", "name": name, **sent})
        if "value" in reply:
            try:
                return from_wire(reply["value"])
            except WireError as exc:
                raise self.lose(f"a broken value: {exc}") from None
        if "raised" in reply:
            raise _exception(reply)
        raise self.lose("a reply without a value or an exception")


class _Proxy:
    """Stands for one of the program's callables in the tests' namespace."""

    def __init__(self, session: _Session, name: str) -> None:
        self._session, self._name = session, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.call(self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<candidate {self._name}>"


@dataclass
class _Verdicts:
    loaded: dict[str, Any] | None = None
    passed: int = 0
    first_failure: tuple[str, str] | None = None
    finished: bool = False
    lost: str | None = None


def _failure(exc: BaseException) -> str:
    if isinstance(exc, MemoryError):
        return "memory"
    return "wrong" if isinstance(exc, AssertionError) else "error"


def _judge(
    channel: Channel,
    context: CodeType,
    tests: list[CodeType],
    entry_points: Sequence[str],
    wanted: frozenset[str],
    out: _Verdicts,
) -> None:
    """The checker's side of a run: bind the program's names, run each test once, count."""
    session = _Session(channel)
    try:
        out.loaded = session.first()
        if out.loaded.get("loaded") is not True:
            return
        ns: dict[str, Any] = {"__name__": "checker", "__builtins__": builtins}
        exec(context, ns)  # trusted: the task's own code (HumanEval's prompt: its helpers, its imports)
        names = sorted(set(entry_points) | {n for n in wanted if n not in ns and not hasattr(builtins, n)})
        kinds = session.request({"op": "names", "names": names}).get("names") if names else {}
        if not isinstance(kinds, dict):
            raise session.lose("a broken reply to the names request")
        for name in names:
            info = kinds.get(name)
            info = info if isinstance(info, dict) else {}
            kind = info.get("kind")
            if kind == "callable":
                ns[name] = _Proxy(session, name)
            elif kind == "value":
                try:
                    ns[name] = from_wire(info.get("value"))
                except WireError as exc:
                    raise session.lose(f"a broken value of {name}: {exc}") from None
            elif kind == "module" and info.get("module") == name and name in _stdlib_modules():
                ns[name] = __import__(name)  # what the tests expected the program to have imported
            elif name in entry_points:
                ns.pop(name, None)  # not the context's stub: a test that calls it fails with NameError
        for i, test in enumerate(tests):
            try:
                exec(test, ns)
            except RunLost:
                break
            except Exception as exc:
                if out.first_failure is None:
                    message = f": {str(exc)[:200]}" if str(exc) else ""
                    out.first_failure = (_failure(exc), f"test {i}: {type(exc).__name__}{message}")
            else:
                out.passed += 1
        out.finished = session.lost is None
    except RunLost:
        pass
    finally:
        out.lost = session.lost


@functools.lru_cache(maxsize=1)
def _stdlib_modules() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names)


def run_tests(
    program: str,
    tests: Sequence[str],
    limits: Limits = Limits(),
    files: Mapping[str, bytes | str] | None = None,
    stdin: bytes = b"",
    *,
    context: str = "",
    entry_points: Sequence[str] = (),
    isolation: str = "auto",
) -> CodeOutcome:
    """Run `program` in the sandbox and each test here against it (module docstring).

    `context`: trusted code run in the tests' namespace first (helpers the tests use);
    `entry_points`: names always taken from the program (over the context's); any other name the
    tests read and neither they, the context nor the builtins define is asked of the program;
    `isolation`: `run_python`'s."""
    context_code, compiled, wanted = _compiled(context, tuple(tests))
    out = _Verdicts()
    res = run_python(
        candidate_main(program),
        files=files,
        stdin=stdin,
        limits=limits,
        isolation=isolation,
        converse=lambda channel: _judge(channel, context_code, compiled, entry_points, wanted, out),
    )
    if res.status == "setup_error":
        raise RuntimeError(f"code reward: {res.error}")
    total = len(tests)
    loaded = out.loaded or {}
    if loaded.get("loaded") is False:
        kind = "memory" if loaded.get("raised") == "MemoryError" else "error"
        return CodeOutcome(
            0, total, kind, f"the program raised {loaded.get('raised')}: {loaded.get('message', '')}", sandbox=res
        )
    if not res.ok or not out.finished:  # ended early, in error, killed: nothing it answered counts
        if res.status == "timeout":
            kind, detail = "timeout", res.error or ""
        elif res.status == "output_limit":
            kind, detail = "output", res.error or ""
        elif res.memory_error:
            kind, detail = "memory", res.error or "out of memory"
        else:
            kind = "error"
            detail = out.lost or res.error or f"the program ended the run early (exit status {res.returncode})"
        return CodeOutcome(0, total, kind, detail, sandbox=res)
    if out.first_failure is not None:
        return CodeOutcome(out.passed, total, *out.first_failure, sandbox=res)
    return CodeOutcome(out.passed, total, "pass", sandbox=res)
