"""The sandbox against real hostile programs: each costs its own run and nothing else.

Every test runs a program that really does the hostile thing (forks without end, allocates without
end, spins, reads the run's files and environment, opens sockets, signals other processes, writes
outside its directory, floods stdout, leaves daemons behind) and checks what the sandbox let through
and that nothing outlives the run. "auto" is the strongest isolation this machine allows;
"user_ns" the path a non-root trainer takes; "none" the fallback without namespaces.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner
from mcore_rl.rewards.checker import run_tests
from mcore_rl.rewards.code import code_reward
from mcore_rl.rewards.sandbox import Limits, probe, run_python, seccomp_program

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

FAST = Limits(cpu_s=2, wall_s=5, memory_mb=256, nproc=16, output_bytes=4096)
MODES = ["auto", "user_ns", "none"]


def _mechanisms() -> dict:
    return probe()


MECH = _mechanisms() if sys.platform.startswith("linux") else {}
FALLBACK = probe("none") if sys.platform.startswith("linux") else {}
needs_ns = pytest.mark.skipif(not MECH.get("pid_ns"), reason="this kernel refuses namespaces")


def _needs_stdlib(mode: str) -> None:
    if mode == "none" and not FALLBACK.get("stdlib"):
        pytest.skip(
            "without a private root this interpreter's standard library is not readable by the "
            "program's uid (it lives under a private directory such as /root)"
        )


def _leftovers(marker: str) -> list[int]:
    """Live processes whose command line names `marker` (every process of a run is a fork of the
    bootstrap, whose arguments hold the run's temporary directory)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            out.append(int(pid))
    return out


def _report(res) -> dict:
    assert res.status == "exited", (res.status, res.error, res.stderr[-500:])
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_capped_and_leaves_nothing(tmp_path, mode: str) -> None:
    bomb = """
import os, time
while True:
    try:
        if os.fork() > 0:
            os.write(3, b"+")
    except OSError:
        time.sleep(0.01)
"""
    limits = Limits(cpu_s=5, wall_s=2, nproc=16)
    box: dict = {}
    thread = threading.Thread(
        target=lambda: box.update(bomb=run_python(bomb, limits=limits, isolation=mode, tmp_dir=str(tmp_path)))
    )
    thread.start()
    time.sleep(0.5)
    other = run_python("print(sum(range(10)))", limits=FAST, isolation=mode)  # another sample meanwhile
    thread.join()
    res = box["bomb"]
    assert other.ok and other.stdout == b"45\n"
    assert res.status == "timeout"
    assert 0 < res.results.count(b"+") < limits.nproc + (0 if res.mechanisms["uid"] != "shared" else 10**6)
    _gone(str(tmp_path))


def _gone(marker: str) -> None:
    """Every process of the run is dead within a second of its return (SIGKILL is asynchronous)."""
    deadline = time.monotonic() + 1
    while _leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leftovers(marker) == []


@pytest.mark.parametrize("mode", MODES)
def test_memory_hogs_get_memory_errors(mode: str) -> None:
    at_once = run_python("x = bytearray(8 << 30)", limits=FAST, isolation=mode)
    assert at_once.status == "exited" and at_once.returncode == 1 and at_once.memory_error
    grow = run_python("l = []\nwhile True:\n    l.append(bytearray(1 << 20))", limits=FAST, isolation=mode)
    assert grow.memory_error and grow.max_rss_mb <= FAST.memory_mb + 16


@pytest.mark.skipif(not MECH.get("cgroup_memory"), reason="no memory cgroup here (needs root and cgroup v1)")
def test_forked_memory_hogs_are_bounded_together() -> None:
    """Six processes of 150 MiB each, each within its own 256 MiB address space: together past the
    run's cgroup limit, so the OOM killer takes some of them, and the run's cgroup is gone after."""
    hog = """
import os, time
kids = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        x = bytearray(150 << 20)
        for j in range(0, len(x), 4096):
            x[j] = 1
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids])
"""
    res = run_python(hog, limits=Limits(memory_mb=256, file_size_mb=8, wall_s=10, cpu_s=10))
    assert res.oom_killed and res.memory_error
    assert -9 in json.loads(res.stdout)  # SIGKILLed by the OOM killer, not all of them
    assert not [d for d in os.listdir("/sys/fs/cgroup/memory/mcore-rl-sandbox") if d.startswith(f"{os.getpid()}-")]


def test_infinite_loops_stop_at_the_cpu_and_the_wall_limit() -> None:
    spin = run_python("while True:\n    pass", limits=Limits(cpu_s=1, wall_s=10))
    assert spin.status == "timeout" and "CPU" in spin.error and spin.wall_s < 8
    start = time.monotonic()
    sleep = run_python("import time\ntime.sleep(60)", limits=Limits(cpu_s=1, wall_s=1))
    assert sleep.status == "timeout" and "wall" in sleep.error and time.monotonic() - start < 3 + sleep.waited_s


_CPU_BOUND = """
import time
start = time.process_time()
while time.process_time() - start < 0.35:
    pass
print("done")
"""


def test_waiting_for_a_cpu_moves_the_wall_deadline_sleeping_does_not() -> None:
    """On a loaded machine a correct program waits for a core: that wait (the kernel's run-queue
    time of the run's processes) is credited to the wall deadline, so the program finishes instead
    of being scored a timeout; a program that sleeps earns no credit. The load: four spinning
    processes on the one CPU the sandbox runs on (affinity is inherited): the program needs about
    a fraction of its wall limit of CPU time, and gets a fifth of the CPU at most."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    # each in a session of its own, as the sandbox's bootstrap is: where the kernel groups CPU shares
    # by session (autogroup), four hogs in one session would take only half the CPU
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin, start_new_session=True) for _ in range(4)]
    try:
        starved = run_python(_CPU_BOUND, limits=Limits(cpu_s=5, wall_s=1.5, wait_credit=0))
        assert starved.status == "timeout" and starved.waited_s == 0  # without the credit: a timeout
        credited = run_python(_CPU_BOUND, limits=Limits(cpu_s=5, wall_s=1.5, wait_credit=50))
        assert credited.ok and credited.stdout == b"done\n", credited
        assert credited.waited_s > 0.3 and credited.wall_s > 1.5
        sleeper = run_python("import time\ntime.sleep(30)", limits=Limits(cpu_s=5, wall_s=1.5, wait_credit=50))
        assert sleeper.status == "timeout" and "credited for waiting" in (sleeper.error or "") or sleeper.waited_s == 0
        assert sleeper.wall_s < 1.5 + sleeper.waited_s + 1.5 and sleeper.waited_s < 3  # its start-up's wait only
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        os.sched_setaffinity(0, before)


_READER = """
import json, os
out = {}
for path in PATHS:
    try:
        with open(path) as f:
            out[path] = f.read()[:100]
    except OSError as exc:
        out[path] = type(exc).__name__
out["env"] = dict(os.environ)
out["root"] = sorted(os.listdir("/"))
out["cwd"] = os.getcwd()
print(json.dumps(out))
"""


@needs_ns
@pytest.mark.parametrize("mode", ["auto", "user_ns"])
def test_run_files_and_environment_are_not_readable(tmp_path, monkeypatch, mode: str) -> None:
    secret = tmp_path / "api_key.txt"
    secret.write_text("sk-very-secret")
    secret.chmod(0o644)
    monkeypatch.setenv("MCORE_SECRET_TOKEN", "hunter2")
    paths = [
        str(secret),
        os.path.abspath(__file__),
        "/etc/passwd",
        f"/proc/{os.getpid()}/environ",
        "/proc/self/environ",
        os.path.expanduser("~/.bash_history"),
        "given.txt",
    ]
    res = run_python(f"PATHS = {paths!r}\n{_READER}", files={"given.txt": "task data"}, limits=FAST, isolation=mode)
    out = _report(res)
    assert out["given.txt"] == "task data"  # what the task provides is there
    for path in paths[:-1]:
        assert out[path] in ("FileNotFoundError", "PermissionError"), (path, out[path])
    assert "hunter2" not in res.stdout.decode() and "sk-very-secret" not in res.stdout.decode()
    assert set(out["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL"}
    assert set(out["root"]) <= {
        "usr",
        "bin",
        "sbin",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "dev",
        "tmp",
        "work",
        "root",
        "opt",
        "home",
    }
    assert out["cwd"] == "/work"


_NETWORK = """
import json, socket
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = exc.errno
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=1))
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", PORT)))
attempt("ipv6", lambda: socket.socket(socket.AF_INET6))
attempt("raw", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
attempt("unix", lambda: socket.socketpair())
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", MODES)
def test_no_network(mode: str) -> None:
    _needs_stdlib(mode)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    try:
        res = run_python(f"PORT = {server.getsockname()[1]}\n{_NETWORK}", limits=FAST, isolation=mode)
        out = _report(res)
        assert out["tcp"] != "ok" and out["udp"] != "ok" and out["ipv6"] != "ok" and out["raw"] != "ok", out
        assert out["unix"] == "ok"
        if res.mechanisms.get("seccomp"):  # refused at socket() already, whatever the network namespace
            assert out["tcp"] == out["udp"] == out["ipv6"] == out["raw"] == errno.EAFNOSUPPORT, out
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the trainer's side
    finally:
        server.close()


_SIGNALLER = """
import json, os, signal
out = {}
for name, pid in (("victim", VICTIM), ("bootstrap", os.getppid() or None)):
    try:
        os.kill(pid, signal.SIGKILL)
        out[name] = "ok"
    except (OSError, TypeError) as exc:
        out[name] = type(exc).__name__
try:
    os.kill(-1, signal.SIGKILL)  # everything it may signal
    out["everyone"] = "ok"
except OSError as exc:
    out["everyone"] = type(exc).__name__
print(json.dumps(out))
"""

# The "trainer" of this test is pid 1 of a PID namespace of its own (`unshare`), so that a sandbox
# that failed to stop kill(-1) would kill the test's processes only, not the machine's.
_TRAINER = """
import json, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from mcore_rl.rewards.sandbox import Limits, run_python
victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
source = "VICTIM = %d\\n" % victim.pid + sys.argv[3]
res = run_python(source, limits=Limits(cpu_s=2, wall_s=5), isolation=sys.argv[2])
time.sleep(0.2)
print(json.dumps({"victim_alive": victim.poll() is None, "status": res.status, "stdout": res.stdout.decode()}))
victim.kill()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the test's own PID namespace needs root (unshare --pid)")
@pytest.mark.parametrize("mode", MODES)
def test_cannot_signal_the_trainer_or_other_processes(mode: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-c",
            _TRAINER,
            root,
            mode,
            _SIGNALLER,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["victim_alive"], f"the program killed a process outside its sandbox: {report}"
    out = json.loads(report["stdout"])
    assert out["victim"] != "ok" and out["bootstrap"] != "ok" and out["everyone"] != "ok", out


@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_the_working_directory_fail(tmp_path, mode: str) -> None:
    outside = tmp_path / "planted"
    program = f"""
import json, os
out = {{}}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = type(exc).__name__
attempt("outside", lambda: open({str(outside)!r}, "w").write("x"))
attempt("usr", lambda: open("/usr/planted", "w").write("x"))
attempt("parent", lambda: open("../planted", "w").write("x"))
attempt("here", lambda: open("mine.txt", "w").write("x"))
attempt("big", lambda: open("big.bin", "wb").write(b"x" * (32 << 20)))
def many():
    for i in range(10000):
        with open("f%d" % i, "wb") as f:
            f.write(b"x" * (1 << 20) if i < 64 else b"")
attempt("many", many)
print(json.dumps(out))
"""
    out = _report(run_python(program, limits=Limits(file_size_mb=4, output_bytes=4096), isolation=mode))
    assert out["here"] == "ok" and out["big"] != "ok" and out["usr"] != "ok"
    if mode != "none":
        assert out["outside"] != "ok" and out["many"] != "ok"  # the working directory is a capped tmpfs
    assert not outside.exists()
    assert not os.path.exists("/usr/planted")


def test_output_floods_are_cut_at_the_cap() -> None:
    for stream in ("stdout", "stderr"):
        start = time.monotonic()
        res = run_python(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)", limits=FAST)
        assert res.status == "output_limit" and time.monotonic() - start < 3
        assert len(getattr(res, stream)) == FAST.output_bytes


@pytest.mark.parametrize("mode", MODES)
def test_daemons_do_not_outlive_the_run(tmp_path, mode: str) -> None:
    program = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.close(1); os.close(2)
        time.sleep(120)
    os._exit(0)
print("parent done")
"""
    res = run_python(program, limits=FAST, isolation=mode, tmp_dir=str(tmp_path))
    assert res.ok and res.stdout == b"parent done\n"
    _gone(str(tmp_path))


@needs_ns
@pytest.mark.parametrize("mode", ["auto", "user_ns"])
def test_privileged_calls_are_refused(mode: str) -> None:
    program = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def call(name, fn):
    try:
        r = fn()
        out[name] = "ok" if r in (None, 0) else os.strerror(ctypes.get_errno())
    except OSError as exc:
        out[name] = type(exc).__name__
call("setuid0", lambda: os.setuid(0) if os.getuid() else libc.mount(b"none", b"/work", b"tmpfs", 0, None))
call("unshare", lambda: libc.unshare(0x10000000))
call("mount", lambda: libc.mount(b"none", b"/work", b"tmpfs", 0, None))
call("ptrace", lambda: libc.ptrace(16, 1, None, None))
call("chroot", lambda: os.chroot("/work"))
print(json.dumps(out))
"""
    out = _report(run_python(program, limits=FAST, isolation=mode))
    assert all(v != "ok" for v in out.values()), out


def test_mechanisms_are_reported_and_missing_ones_warned(caplog) -> None:
    assert {"pid_ns", "net_ns", "mount_ns", "uid", "rlimits", "no_new_privs"} <= set(MECH)
    if os.geteuid() == 0 and MECH["pid_ns"]:
        assert MECH["filesystem"] == "private root" and MECH["uid"] == "own" and MECH["rlimits"] == "all"
    with caplog.at_level(logging.WARNING, logger="mcore_rl.rewards.sandbox"):
        res = run_python("pass", isolation="none")
    assert res.ok and res.mechanisms["pid_ns"] is False and res.mechanisms["filesystem"] == "shared"
    # the warning is logged once per process: by this call or an earlier one of this session
    assert res.mechanisms.get("seccomp") in (True, None)


def test_seccomp_program_jumps_stay_inside_the_filter() -> None:
    prog = seccomp_program()
    assert len(prog) < 4096 and prog[-1] == (0x06, 0, 0, 0x7FFF0000)
    for i, (code, jt, jf, _) in enumerate(prog):
        if code & 0x07 == 0x05:  # BPF_JMP
            assert i + 1 + max(jt, jf) < len(prog)
        else:
            assert jt == jf == 0


def test_hostile_samples_cost_their_own_sample_in_the_reward_workers() -> None:
    tests = ["assert f(2) == 5", "assert f(0) == 1"]
    label = {"tests": tests, "template": "f = {program}", "limits": {"wall_s": 5, "cpu_s": 2, "output_bytes": 4096}}
    completions = [
        "lambda x: 2*x+1",
        "(__import__('os').kill(__import__('os').getppid(), 9), lambda x: 2*x+1)[1]",
        "[__import__('os').fork() for _ in iter(int, 1)]",
        "print('x' * 10**6) or (lambda x: 2*x+1)",
        "lambda x: 1",
        "```python\nf = lambda x: 2*x+1\n```",
    ]
    samples = [RewardInput("p", c, label) for c in completions]
    with RewardRunner(RewardFunction(code_reward, timeout_s=20), max_concurrency=2) as runner:
        runner.start(wait_ready=True)
        before = sorted(runner.worker_pids())
        results = runner.score_sync(samples)
        assert sorted(runner.worker_pids()) == before  # no reward worker was lost
    assert [r.error for r in results] == [None] * len(samples)
    rewards = [r.reward for r in results]
    kinds = [r.info["kind"] for r in results]
    assert rewards[0] == rewards[5] == 1.0 and kinds[0] == kinds[5] == "pass"
    assert rewards[2] == 0.0 and kinds[2] in ("timeout", "error")  # fork fails at the cap: raises
    assert rewards[3] == 0.0 and kinds[3] == "output"
    assert rewards[4] == 0.5 and kinds[4] == "wrong"
    assert kinds[1] in ("pass", "error")  # its kill reached nothing outside the sandbox


def test_a_reward_worker_killed_at_its_timeout_takes_its_sandbox_with_it() -> None:
    """The worker is SIGKILLed (its process group: not the sandbox's); PR_SET_PDEATHSIG ends the rest."""
    label = {"tests": ["assert True"], "limits": {"wall_s": 60, "cpu_s": 60}}
    before = set(_leftovers("mcore-sandbox-"))
    with RewardRunner(RewardFunction(code_reward, timeout_s=1.5), max_concurrency=1) as runner:
        runner.start(wait_ready=True)
        results = runner.score_sync([RewardInput("p", "import time\ntime.sleep(60)", label)])
    assert results[0].error is not None and "timeout" in results[0].error
    deadline = time.monotonic() + 10  # a wait on the condition: load only stretches it
    while set(_leftovers("mcore-sandbox-")) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(_leftovers("mcore-sandbox-")) - before == set()
    if MECH.get("cgroup_memory"):  # the dead worker's cgroup goes with the next run
        run_python("pass")
        top = "/sys/fs/cgroup/memory/mcore-rl-sandbox"
        owners = [d.split("-", 1)[0] for d in os.listdir(top) if os.path.isdir(os.path.join(top, d))]
        assert all(os.path.exists(f"/proc/{pid}") for pid in owners), owners


# ------------------------------------------------------------- runs that attack their own supervision


def _no_cgroups(monkeypatch, tmp_path) -> None:
    """As on a machine without a cgroup we may write (cgroup v2 without delegation, not root)."""
    from mcore_rl.rewards import sandbox

    monkeypatch.setattr(sandbox, "_CGROUP_ROOT", str(tmp_path / "no-cgroup-v1"))
    monkeypatch.setattr(sandbox, "_CGROUP_V2", str(tmp_path / "no-cgroup-v2"), raising=False)


@needs_ns
@pytest.mark.parametrize("mode", ["auto", "user_ns"])
def test_a_program_that_leaves_its_session_and_death_signal_dies_with_its_run(tmp_path, monkeypatch, mode: str) -> None:
    """Clearing PR_SET_PDEATHSIG and calling setsid() let the program outlive the run wherever no
    cgroup held it; the death signal and the session are now locked (seccomp)."""
    _no_cgroups(monkeypatch, tmp_path)
    program = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
for attempt in range(2):
    print("prctl", libc.prctl(1, 0, 0, 0, 0), ctypes.get_errno(), flush=True)
    try:
        os.setsid()
    except OSError as exc:
        print("setsid", exc.errno, flush=True)
    if attempt == 0 and os.fork() != 0:
        break
time.sleep(60)
"""
    res = run_python(program, limits=Limits(cpu_s=2, wall_s=4, memory_mb=256), isolation=mode, tmp_dir=str(tmp_path))
    assert res.status == "timeout" and not res.mechanisms.get("cgroup_kill"), (res.status, res.mechanisms)
    try:
        _gone(str(tmp_path))
    finally:  # (a regression must not leave them running)
        for pid in _leftovers(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
    assert b"prctl -1 1" in res.stdout and b"setsid 1" in res.stdout, res.stdout


@needs_ns
def test_killing_its_process_group_does_not_reach_the_supervisor() -> None:
    """kill(0, SIGKILL) reached the bootstrap on the non-root path (same uid, same group): the run
    ended as a set-up error, a dropped sample. The program now has a session of its own."""
    program = """
import os, time
if os.fork() == 0:
    os.kill(0, 9)
time.sleep(0.2)
print("alive")
"""
    res = run_python(program, limits=FAST, isolation="user_ns")
    assert res.status == "exited" and res.stdout == b"alive\n", (res.status, res.error)
    out = run_tests(program + "\ndef f(x):\n    return x\n", ["assert f(1) == 1"], FAST, isolation="user_ns")
    assert out.kind == "pass", out


def _bootstraps_of_this_process(marker: str) -> list[int]:
    out = []
    for pid in _leftovers(marker):
        try:
            with open(f"/proc/{pid}/status") as f:
                ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if ppid == os.getpid():
            out.append(pid)
    return out


def test_a_supervisor_killed_while_the_program_runs_is_the_programs_failure(tmp_path, monkeypatch) -> None:
    """What can kill the bootstrap once the program runs (the OOM killer at the run's limit, memory
    no process is charged for) the program can cause: the run scores 0, it is not a reward error."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    slow = "import time\ntime.sleep(5)\ndef f(x):\n    return x\n"

    def sleeping() -> bool:  # the program runs: it is in its time.sleep
        for pid in _leftovers(str(tmp_path)):
            try:
                with open(f"/proc/{pid}/wchan") as f:
                    if "nanosleep" in f.read():
                        return True
            except OSError:
                continue
        return False

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_tests, slow, ["assert f(1) == 1"], Limits(cpu_s=5, wall_s=10))
        deadline = time.monotonic() + 8
        while not sleeping() and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in _bootstraps_of_this_process(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
        out = future.result(timeout=20)
    assert out.reward() == 0.0 and out.kind == "error" and out.sandbox.status == "supervisor_killed", out
    _gone(str(tmp_path))


def test_a_reward_worker_killed_mid_run_leaves_no_files(tmp_path, monkeypatch) -> None:
    """The worker's temporary directory (the program, its files) goes with it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # this process's and (before the fix) its workers'
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    label = {"tests": ["assert f(1) == 1"], "limits": {"wall_s": 60, "cpu_s": 60}}
    with RewardRunner(RewardFunction(code_reward, timeout_s=1.5), max_concurrency=1) as runner:
        runner.start(wait_ready=True)
        results = runner.score_sync([RewardInput("p", "import time\ntime.sleep(60)", label)])
        assert results[0].error is not None and "timeout" in results[0].error
        # only the replacement worker's own directory remains, empty
        left = os.listdir(tmp_path)
        assert len(left) <= len(runner.worker_pids()), left
        for name in left:
            assert name.startswith(f"mcore-reward-worker-{os.getpid()}-") and os.listdir(tmp_path / name) == [], left
    assert os.listdir(tmp_path) == []


def test_orphaned_run_directories_are_swept(tmp_path) -> None:
    """A run directory whose owner died (SIGKILL before its `finally`) goes with the next run there."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"mcore-sandbox-{int(dead.stdout)}-x"
    (orphan / "files").mkdir(parents=True)
    (orphan / "job.json").write_text("{}")
    assert run_python("pass", tmp_dir=str(tmp_path)).ok
    assert not orphan.exists() and os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/memory"), reason="needs root and cgroup v1")
def test_a_cgroup_v2_holds_the_run_without_cgroup_v1(tmp_path, monkeypatch) -> None:
    """Without cgroup v1's memory controller, a cgroup-v2 cgroup (where one is writable) still holds
    every process of the run and `cgroup.kill` ends them; it is removed after the run."""
    from mcore_rl.rewards import sandbox

    monkeypatch.setattr(sandbox, "_CGROUP_ROOT", str(tmp_path / "no-cgroup-v1"))
    home = sandbox._cgroup_v2_home()
    if home is None:
        pytest.skip("no writable cgroup v2 here")
    res = run_python(
        "import os\nprint(open('/proc/self/cgroup').read() if os.path.exists('/proc/self') else '')",
        limits=FAST,
        isolation="none",
    )
    assert res.ok and res.mechanisms["cgroup_kill"], res.mechanisms
    parent = os.path.join(home, "mcore-rl-sandbox")
    assert [d for d in os.listdir(parent) if d.startswith(f"{os.getpid()}-")] == []


@pytest.mark.skipif(not MECH.get("cgroup_memory"), reason="no memory cgroup here (needs root and cgroup v1)")
@pytest.mark.parametrize("mode", ["auto", "user_ns"])
def test_memory_no_process_is_charged_for_costs_the_program_not_the_sample(mode: str) -> None:
    """memfd pages fill the run's cgroup without raising any process's RSS, so the OOM killer could
    take the bootstrap (a reward error). The program's processes are the OOM killer's first choice
    (oom_score_adj 1000), and a bootstrap lost anyway is the program's failure: the sample scores 0.
    (Here the kernel took the program even before; the test holds the outcome.)"""
    filler = """
import os
fds = []
for i in range(40):
    fd = os.memfd_create("x%d" % i)
    os.write(fd, b"\\0" * (7 << 20))
    fds.append(fd)
def f(x):
    return 3 * x + 1
"""
    limits = Limits(cpu_s=5, wall_s=8, memory_mb=64, file_size_mb=8, nofile=64)
    out = run_tests(filler, ["assert f(1) == 4"], limits, isolation=mode)
    assert out.reward() == 0.0 and out.kind in ("memory", "error") and out.sandbox.oom_killed, out


@needs_ns
def test_the_oom_killer_prefers_the_programs_processes(tmp_path) -> None:
    box: dict = {}
    program = "import os, time\nif os.fork() == 0:\n    time.sleep(2)\ntime.sleep(2)\n"
    limits = Limits(cpu_s=2, wall_s=15, memory_mb=256)  # (the program sleeps 2 s; a loaded machine starts slowly)
    thread = threading.Thread(target=lambda: box.update(res=run_python(program, limits=limits, tmp_dir=str(tmp_path))))
    thread.start()
    scores: dict[int, int] = {}
    boots: list[int] = []
    deadline = time.monotonic() + 4
    while len(scores) < 3 and time.monotonic() < deadline:
        boots = boots or _bootstraps_of_this_process(str(tmp_path))
        for pid in _leftovers(str(tmp_path)):
            try:
                with open(f"/proc/{pid}/oom_score_adj") as f:
                    scores[pid] = int(f.read())
            except OSError:
                continue
        time.sleep(0.05)
    thread.join()
    assert len(scores) == 3 and len(boots) == 1 and scores[boots[0]] < 1000, (scores, boots)
    assert sorted(v for p, v in scores.items() if p != boots[0]) == [1000, 1000], scores
    assert box["res"].ok
