"""Run an untrusted Python program in a throw-away, locked-down process (docs/sandbox.md).

A code reward runs whatever the policy wrote. The program must cost its own sample and nothing
else: not the reward worker that runs it, not the trainer, not other samples. `run_python` starts
a fresh interpreter (`python -I -S -B` this file: no environment variables, no site-packages)
with a clean environment; that *bootstrap* reads the job, enters new namespaces, forks the
program's process and reports how it ended. The program's process, before it runs a line of the
program:

- is pid 1 of a new PID namespace (every process it forks dies with it; it sees no other process),
- is in a new network namespace (a loopback that is down: no network at all), IPC and UTS ones,
- sees a new root filesystem (mount namespace + `pivot_root`): read-only binds of /usr, /lib* and
  the interpreter's standard library (its site-packages hidden), /dev/null, /dev/zero,
  /dev/urandom, and a size-capped tmpfs at /work holding only the files the task gave,
- has CPU-time, address-space, file-size, open-file and process-count limits (`setrlimit`),
- runs as an unprivileged uid of its own (when we are root: RLIMIT_NPROC does not bind root, and
  a uid per sample keeps one sample's fork bomb from using another's budget), or, when we are not
  root, as root of a new user namespace with every capability dropped,
- has `PR_SET_NO_NEW_PRIVS` and a seccomp filter: no sockets but AF_UNIX, no ptrace, mount,
  namespaces, kernel modules, bpf, perf, keyrings, io_uring, ... (x86_64),
- dies when the bootstrap dies, which dies when its parent (the reward worker) does; it cannot
  clear that death signal or leave its session or process group (seccomp), and, where a cgroup
  can be made (cgroup v1 memory as root; cgroup v2 as root or in a delegated subtree), all its
  processes are in the run's cgroups, killed together at the end.

The parent enforces the wall time, caps stdout and stderr (a flood is killed at the cap) and
SIGKILLs the process group. A bootstrap that dies after the program started (the program can
cause that) ends the run as `supervisor_killed`, the program's failure; only a sandbox that could
not be built is a `setup_error`. A mechanism the kernel refuses is skipped with a warning logged once
per process (`SandboxResult.mechanisms` says what was in force), so the same code runs on a laptop,
in a container and on a cluster node; `probe()` reports what this machine allows.

Besides stdout and stderr the program has a third channel, file descriptor 3: a pipe captured as
`SandboxResult.results`, or, with `run_python(converse=...)`, a socket to the caller, who talks to
the running program one line at a time (the code reward's checker: `mcore_rl/rewards/checker.py`).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable

# -------------------------------------------------------------------------------- shared constants

_UID_BASE = 1_900_000_000  # + the bootstrap's pid: a uid no one else uses, distinct per live sandbox
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET, _CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
_RESULTS_FD = 3
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}


# ================================================================================== child side
# Runs in the bootstrap interpreter (`python -I -S -B sandbox.py ...`): standard library only.


class _Kernel:
    """The few system calls Python 3.11's `os` lacks, through libc."""

    def __init__(self) -> None:
        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long
        self.nr = _SYSCALLS.get(os.uname().machine, {})

    def _check(self, ret: int, what: str) -> None:
        if ret != 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def unshare(self, flags: int) -> None:
        self._check(self.libc.unshare(flags), "unshare")

    def mount(self, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        def enc(s: str | None) -> bytes | None:
            return None if s is None else s.encode()

        self._check(
            self.libc.mount(enc(src), enc(target), enc(fstype), self.ctypes.c_ulong(flags), enc(data)),
            f"mount {target}",
        )

    def umount_detach(self, target: str) -> None:
        self._check(self.libc.umount2(target.encode(), 2), f"umount {target}")  # MNT_DETACH

    def pivot_root(self, new: str, old: str) -> None:
        if "pivot_root" not in self.nr:
            raise OSError(38, f"pivot_root: no syscall number known for {os.uname().machine}")
        self._check(self.libc.syscall(self.nr["pivot_root"], new.encode(), old.encode()), "pivot_root")

    def prctl(self, option: int, arg: int, what: str) -> None:
        c = self.ctypes
        self._check(self.libc.prctl(option, c.c_ulong(arg), c.c_ulong(0), c.c_ulong(0), c.c_ulong(0)), what)

    def drop_capabilities(self) -> None:
        """capset(2) to nothing: effective, permitted and inheritable sets empty (v3 header)."""
        c = self.ctypes
        header = (c.c_uint32 * 2)(0x20080522, 0)
        data = (c.c_uint32 * 6)()
        if "capset" not in self.nr:
            raise OSError(38, f"capset: no syscall number known for {os.uname().machine}")
        self._check(self.libc.syscall(self.nr["capset"], header, data), "capset")

    def seccomp(self, program: list[tuple[int, int, int, int]]) -> None:
        c = ctypes

        class SockFilter(ctypes.Structure):
            _fields_ = [("code", c.c_uint16), ("jt", c.c_uint8), ("jf", c.c_uint8), ("k", c.c_uint32)]

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", c.c_uint16), ("filter", c.POINTER(SockFilter))]

        filters = (SockFilter * len(program))(*[SockFilter(*ins) for ins in program])
        prog = SockFprog(len(program), filters)
        self._check(self.libc.prctl(22, c.c_ulong(2), c.byref(prog), c.c_ulong(0), c.c_ulong(0)), "seccomp")


# seccomp (x86_64): syscalls that a test program has no business making -> EPERM.
_DENIED_SYSCALLS = {
    "ptrace": 101,
    "syslog": 103,
    "personality": 135,
    "vhangup": 153,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    # leaving the run's session or process group: the caller kills the run by its group
    "setsid": 112,
    "setpgid": 109,
}
_SYS_PRCTL, _PR_SET_PDEATHSIG = 157, 1
_SYS_SOCKET, _SYS_CLONE, _SYS_CLONE3 = 41, 56, 435
# signals: kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo, pidfd_send_signal, pidfd_open
_SYS_KILL = 62
_SIGNAL_SYSCALLS = (62, 200, 234, 129, 297, 424, 434)
_AF_UNIX = 1
_AUDIT_ARCH_X86_64 = 0xC000003E
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97


def seccomp_program(signals: bool = True) -> list[tuple[int, int, int, int]]:
    """The BPF filter (code, jt, jf, k): wrong architecture or the x32 ABI -> kill; a denied
    syscall -> EPERM; socket() of any family but AF_UNIX -> EAFNOSUPPORT; clone() with a namespace
    flag -> EPERM; clone3 -> ENOSYS (its flags sit in memory a filter cannot read: libc falls back
    to clone); setsid, setpgid and prctl(PR_SET_PDEATHSIG) -> EPERM (the program stays in the group
    the caller kills and keeps the death signal that kills it with its bootstrap); kill(-1, ...) ->
    EPERM; with `signals=False` (the program shares the trainer's uid and PID namespace: any signal
    could reach the trainer) every signal-sending call -> EPERM; everything else allowed."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000

    def errno(e: int) -> int:
        return 0x00050000 | e

    prog = [
        (ld, 0, 0, 4),
        (jeq, 1, 0, _AUDIT_ARCH_X86_64),
        (ret, 0, 0, kill),
        (ld, 0, 0, 0),
        (jge, 0, 1, 0x40000000),
        (ret, 0, 0, kill),
    ]
    for nr in sorted(_DENIED_SYSCALLS.values()):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, errno(_EPERM))]
    if not signals:
        for nr in _SIGNAL_SYSCALLS:
            prog += [(jeq, 0, 1, nr), (ret, 0, 0, errno(_EPERM))]
    prog += [(jeq, 0, 1, _SYS_CLONE3), (ret, 0, 0, errno(_ENOSYS))]
    # prctl(PR_SET_PDEATHSIG, ...): the death signal that takes the program with its bootstrap stays
    prog += [(jeq, 0, 3, _SYS_PRCTL), (ld, 0, 0, 16), (jeq, 0, 1, _PR_SET_PDEATHSIG), (ret, 0, 0, errno(_EPERM))]
    prog += [(ld, 0, 0, 0)]
    ns_flags = (
        _CLONE_NEWNS | _CLONE_NEWUTS | _CLONE_NEWIPC | _CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWCGROUP
    )
    prog += [(jeq, 0, 3, _SYS_CLONE), (ld, 0, 0, 16), (jset, 0, 1, ns_flags), (ret, 0, 0, errno(_EPERM))]
    # kill(-1, sig) signals everything the caller may signal: never needed by a test program
    prog += [(ld, 0, 0, 0), (jeq, 0, 3, _SYS_KILL), (ld, 0, 0, 16), (jeq, 0, 1, 0xFFFFFFFF), (ret, 0, 0, errno(_EPERM))]
    prog += [
        (ld, 0, 0, 0),
        (jeq, 0, 3, _SYS_SOCKET),
        (ld, 0, 0, 16),
        (jeq, 1, 0, _AF_UNIX),
        (ret, 0, 0, errno(_EAFNOSUPPORT)),
    ]
    prog += [(ret, 0, 0, allow)]
    return prog


def _statvfs_flags(path: str | int) -> int:
    """The mount flags of `path` (or an open descriptor) that a bind remount must keep (locked in a
    user namespace)."""
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((1, 1), (2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21)):
        if f & st:
            out |= ms
    return out


def _make_root(k: _Kernel, base: str, job: dict, uid: int) -> None:
    """Build the program's filesystem under base/root and pivot into it."""
    rdonly, nosuid, nodev, remount, bind, rec, private = 1, 2, 4, 32, 4096, 16384, 1 << 18
    # relative to the working directory, which is `base`: the path down to it may not be traversable
    # by a user namespace's root; base/root was made by the parent (that root may not write in base)
    new = "root"
    k.mount(None, "/", None, rec | private)
    k.mount("tmpfs", new, "tmpfs", nosuid | nodev, "size=1m,nr_inodes=4096,mode=0755")

    def inside(path: str) -> str:
        return new + path

    for path, target, fd in job["ro_entries"]:
        if target is not None:  # a symlink such as /lib -> usr/lib
            os.makedirs(os.path.dirname(inside(path)), exist_ok=True)
            os.symlink(target, inside(path))
            continue
        os.makedirs(inside(path), exist_ok=True)
        # from the descriptor opened before the uid changed: the path itself may not be traversable now
        k.mount(f"/proc/self/fd/{fd}", inside(path), None, bind | rec)
        k.mount(None, inside(path), None, remount | bind | rdonly | nosuid | nodev | _statvfs_flags(fd))
    for path in job["hidden_paths"]:
        if os.path.isdir(inside(path)):
            k.mount("tmpfs", inside(path), "tmpfs", rdonly | nosuid | nodev, "size=4k,nr_inodes=8")
    os.mkdir(inside("/dev"), 0o755)
    for dev in ("null", "zero", "urandom"):
        open(inside(f"/dev/{dev}"), "w").close()
        k.mount(f"/dev/{dev}", inside(f"/dev/{dev}"), None, bind)
        k.mount(None, inside(f"/dev/{dev}"), None, remount | bind | nosuid | _statvfs_flags(f"/dev/{dev}"))
    work = inside("/work")
    os.mkdir(work, 0o700)
    size_kb = max(64, job["limits"]["file_size_mb"] * 1024)
    k.mount("tmpfs", work, "tmpfs", nosuid | nodev, f"size={size_kb}k,nr_inodes=1024,mode=0700,uid={uid},gid={uid}")
    _write_files(job["files"], work, uid)
    os.symlink("/work", inside("/tmp"))
    k.mount(None, new, None, remount | rdonly | nosuid | nodev)
    os.chdir(new)  # (relative to base)
    try:  # the old root goes away entirely: not reachable by any path
        k.pivot_root(".", ".")
        k.umount_detach(".")
    except OSError:  # still unreachable once the capabilities are gone (chroot needs CAP_SYS_CHROOT)
        os.chroot(".")
    os.chdir("/work")


def _read_files(src: str) -> dict[str, bytes]:
    """The task's files (relative path -> bytes), read before the bootstrap gives up its rights."""
    out = {}
    for root, _, names in os.walk(src):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, src)] = f.read()
    return out


def _write_files(files: dict[str, bytes], dst: str, uid: int) -> None:
    """Write the task's files into the working directory, owned by the program's uid."""
    for rel, content in files.items():
        path = os.path.join(dst, rel)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent)
            os.chown(parent, uid, uid)
        with open(path, "wb") as f:
            f.write(content)
        os.chown(path, uid, uid)


def _cpu_limit(cpu_s: float) -> int:
    """RLIMIT_CPU in whole seconds, rounded up."""
    return max(1, int(-(-cpu_s // 1)))


def _tasks_of_uid(uid: int) -> int:
    """How many tasks (threads) `uid` has now, from /proc."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return n


def _set_limits(lim: dict, nproc_base: int) -> None:
    import resource

    cpu = _cpu_limit(lim["cpu_s"])
    mem = lim["memory_mb"] << 20
    fsize = lim["file_size_mb"] << 20
    # soft = hard: SIGKILL at the limit (pid 1 of a PID namespace ignores SIGXCPU, the soft limit's signal)
    todo = [
        (resource.RLIMIT_CPU, cpu, cpu),
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NOFILE, lim["nofile"], lim["nofile"]),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_MEMLOCK, 0, 0),
        (resource.RLIMIT_MSGQUEUE, 0, 0),
    ]
    todo.append((resource.RLIMIT_NPROC, nproc_base + lim["nproc"], nproc_base + lim["nproc"]))
    for which, soft, hard in todo:
        resource.setrlimit(which, (soft, hard))


def _child(
    k: _Kernel, base: str, job: dict, mech: dict, uid: int, stdin_fd: int, results_fd: int, report_w: int, go_r: int
) -> None:
    """The program's process: lock it down, report to the bootstrap, run the program. Never returns."""
    import fcntl  # loaded by the bootstrap before any uid change (see `_bootstrap`)

    warnings: list[str] = []
    try:
        k.prctl(1, 9, "PR_SET_PDEATHSIG")  # SIGKILL when the bootstrap dies
        if job["bootstrap_pid"] != os.getppid() and not mech["pid_ns"]:
            os._exit(125)
        try:  # the OOM killer's first choice (raising needs no privilege; with a private root there
            # is no /proc to lower it again): it takes the program, never its supervisor
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        if mech["pid_ns"]:
            # a session of its own, inside its PID namespace: kill(0, ...) reaches the program's own
            # processes, not the bootstrap (which shares the caller's uid on the non-root path)
            os.setsid()
        if mech["mount_ns"]:
            try:
                _make_root(k, base, job, uid if mech["uid"] == "own" else 0)
                mech["filesystem"] = "private root"
            except OSError as exc:
                warnings.append(f"no private root filesystem ({exc}): the program sees this machine's files")
        if not mech.get("filesystem"):
            work = os.path.join(os.getcwd(), "work")  # cwd is base
            os.makedirs(work, 0o700, exist_ok=True)
            if mech["uid"] == "own":
                os.chown(work, uid, uid)
            _write_files(job["files"], work, uid if mech["uid"] == "own" else os.getuid())
            os.chdir(work)
            os.environ.update(HOME=work, TMPDIR=work)
            mech["filesystem"] = "shared"
        # RLIMIT_NPROC counts every process of the real uid: only with a uid of our own (or a user
        # namespace of our own) does it count this sample alone
        # RLIMIT_NPROC counts every task of the real uid: with a uid (or user namespace) of our own
        # it counts this sample alone; sharing the trainer's uid, it is what the uid has now + nproc
        shared = mech["uid"] not in ("own", "user_ns")
        _set_limits(job["limits"], nproc_base=_tasks_of_uid(os.getuid()) if shared else 0)
        mech["rlimits"] = "all" if not shared else "all, RLIMIT_NPROC shared with this user's other processes"
        if shared:
            warnings.append(
                "the program runs as the trainer's user: its process limit is shared, and it may not "
                "send signals at all (seccomp)"
            )
        __import__("traceback")  # loaded while the standard library is surely readable (see below)

        if mech["uid"] == "own":
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        mech["stdlib"] = os.access(os.path.dirname(os.__file__), os.R_OK | os.X_OK)
        if not mech["stdlib"]:  # e.g. Python under /root, seen without a private root by another uid
            warnings.append(
                f"the standard library ({os.path.dirname(os.__file__)}) is not readable by the "
                "program's uid: it can import only modules already loaded"
            )
        # a change of uid clears PR_SET_PDEATHSIG: ask again (a bootstrap that died in between is seen
        # below, when the report cannot be written)
        k.prctl(1, 9, "PR_SET_PDEATHSIG")
        try:
            k.drop_capabilities()
            mech["capabilities"] = "none"
        except OSError as exc:
            warnings.append(f"capabilities not dropped ({exc})")
        k.prctl(38, 1, "PR_SET_NO_NEW_PRIVS")
        mech["no_new_privs"] = True
        if os.uname().machine == "x86_64":
            try:
                k.seccomp(seccomp_program(signals=mech["pid_ns"] or mech["uid"] != "shared"))
                mech["seccomp"] = True
            except OSError as exc:
                warnings.append(f"no seccomp filter ({exc})")
        else:
            warnings.append(f"no seccomp filter (its syscall table is x86_64 only, this is {os.uname().machine})")
        report_w, go_r = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) if fd <= _RESULTS_FD else fd for fd in (report_w, go_r))
        os.dup2(stdin_fd, 0)
        os.dup2(results_fd, _RESULTS_FD)
        for fd in (stdin_fd, results_fd):
            if fd > _RESULTS_FD:
                os.close(fd)
        os.write(report_w, json.dumps({"mechanisms": mech, "warnings": warnings}).encode())  # EPIPE: it died
        os.close(report_w)
        # run nothing before the bootstrap has told the caller the program started: from then on
        # a bootstrap killed from inside the run is the program's failure, not a set-up error
        if os.read(go_r, 1) != b"1":
            os._exit(125)
        os.closerange(_RESULTS_FD + 1, 1 << 16)
    except BaseException as exc:
        try:
            os.write(
                report_w,
                json.dumps(
                    {"mechanisms": mech, "warnings": warnings, "setup_error": f"{type(exc).__name__}: {exc}"}
                ).encode(),
            )
        finally:
            os._exit(125)
    os._exit(_run_program(job["source"]))


def _run_program(source: str) -> int:
    """Run `source` as the main module, as `python main.py` would; return its exit status."""
    import builtins
    import traceback

    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    scope = {"__name__": "__main__", "__builtins__": builtins, "__file__": os.path.join(os.getcwd(), "main.py")}
    status = 0
    try:
        exec(compile(source, "main.py", "exec"), scope)
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return status


def _enter_namespaces(k: _Kernel, want: str, mech: dict, uid: int, entered: Callable[[], None]) -> list[str]:
    """unshare(2) into what the kernel allows, calling `entered` in the new namespaces before any
    uid change; fills `mech`, returns warnings."""
    base = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWPID
    euid, egid = os.geteuid(), os.getegid()
    tries = []
    if euid == 0 and want == "auto":
        tries.append((base, "own"))
    if want in ("auto", "user_ns"):
        tries.append((base | _CLONE_NEWUSER, "user_ns"))
    errors = []
    for flags, uid_mode in tries:
        try:
            if flags & _CLONE_NEWUSER and euid == 0:
                _unshare_mapped(k, flags, uid, entered)
            elif flags & _CLONE_NEWUSER:
                k.unshare(flags)
                entered()
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:  # root inside = this user outside
                    f.write(f"0 {euid} 1")
                with open("/proc/self/gid_map", "w") as f:
                    f.write(f"0 {egid} 1")
            else:
                k.unshare(flags)
                entered()
        except OSError as exc:
            errors.append(str(exc))
            continue
        mech.update(
            pid_ns=True, net_ns=True, mount_ns=True, ipc_ns=True, user_ns=bool(flags & _CLONE_NEWUSER), uid=uid_mode
        )
        return []
    entered()
    mech.update(
        pid_ns=False, net_ns=False, mount_ns=False, ipc_ns=False, user_ns=False, uid="own" if euid == 0 else "shared"
    )
    if want == "none":
        return ["namespaces disabled (isolation='none')"]
    return [
        f"no namespaces ({'; '.join(errors) or 'not tried'}): the program shares this machine's network, "
        "processes and files (seccomp still refuses network sockets where it is available)"
    ]


def _unshare_mapped(k: _Kernel, flags: int, uid: int, entered: Callable[[], None]) -> None:
    """As root: a user namespace whose root is `uid` outside, not root (kuid 0 is exempt from
    RLIMIT_NPROC and owns every file). A process in the new namespace may only map itself, so a
    helper left outside writes the maps, like newuidmap(1); then we become that root."""
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(go_w)
        code = 1
        if os.read(go_r, 1) == b"1":
            try:
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{os.getppid()}/{name}", "w") as f:
                        f.write(f"0 {uid} 1")
                code = 0
            except OSError:
                pass
        os._exit(code)
    os.close(go_r)
    try:
        k.unshare(flags)
    except OSError:
        os.write(go_w, b"0")
        os.close(go_w)
        os.waitpid(helper, 0)
        raise
    os.write(go_w, b"1")
    os.close(go_w)
    _, status = os.waitpid(helper, 0)
    if status != 0:
        raise OSError(1, "the user namespace's uid map could not be written")
    entered()
    os.setresgid(0, 0, 0)
    os.setgroups([])
    os.setresuid(0, 0, 0)


def _bootstrap(argv: list[str]) -> None:
    """`python -I -S -B sandbox.py BASE CTL_FD RESULTS_FD PARENT_PID`: see the module docstring."""
    import signal

    base, ctl, results_fd, parent = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    k = _Kernel()
    k.prctl(1, signal.SIGKILL, "PR_SET_PDEATHSIG")
    if os.getppid() != parent:
        os._exit(125)
    with open(os.path.join(base, "job.json")) as f:
        job = json.load(f)
    job["bootstrap_pid"] = os.getpid()
    uid = _UID_BASE + os.getpid()
    job["files"] = _read_files(os.path.join(base, "files"))
    for module in ("resource", "fcntl"):  # os.wait4 and `_child` need them; after a uid change they may
        __import__(module)  # not be importable (a standard library under a private directory)

    def open_ro_paths() -> None:
        # in the new mount namespace (a bind mount's source must be in it), before any uid change
        job["ro_entries"] = [
            (path, os.readlink(path), None)
            if os.path.islink(path)
            else (path, None, os.open(path, os.O_PATH | os.O_DIRECTORY))
            for path in job["ro_paths"]
            if os.path.islink(path) or os.path.isdir(path)
        ]

    stdin_fd = os.open(os.path.join(base, "stdin"), os.O_RDONLY)
    mech: dict = {"cgroup_memory": False, "cgroup_kill": False}
    for cgroup in job["cgroups"]:
        try:  # everything it forks from now on is charged to (and killable through) the run's cgroups
            with open(os.path.join(cgroup["path"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            mech["cgroup_memory"] = mech["cgroup_memory"] or cgroup["memory"]
            mech["cgroup_kill"] = True
        except OSError:
            pass
    try:  # the OOM killer never takes the supervisor (needs CAP_SYS_RESOURCE; the program's 1000 suffices)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass
    warnings = _enter_namespaces(k, job["isolation"], mech, uid, open_ro_paths)
    k.prctl(1, signal.SIGKILL, "PR_SET_PDEATHSIG")  # again: becoming a user namespace's root cleared it
    if os.getppid() != parent:
        os._exit(125)
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ctl)
        os.close(report_r)
        os.close(go_w)
        _child(k, base, job, mech, uid, stdin_fd, results_fd, report_w, go_r)
    os.close(report_w)
    os.close(go_r)
    os.close(results_fd)
    os.close(stdin_fd)
    report = b""
    while chunk := os.read(report_r, 65536):
        report += chunk
    setup: dict[str, Any]
    try:
        setup = (
            json.loads(report)
            if report
            else {"mechanisms": mech, "setup_error": "the program's process died during set-up"}
        )
    except ValueError:
        setup = {"mechanisms": mech, "setup_error": f"unreadable set-up report {report[:200]!r}"}
    setup["warnings"] = list(warnings) + setup.get("warnings", [])
    os.write(ctl, json.dumps(setup).encode() + b"\n")  # first line: what is in force (sent before it runs)
    try:
        os.write(go_w, b"1")
    except OSError:  # it died during set-up
        pass
    os.close(go_w)
    _, status, usage = os.wait4(pid, 0)
    if not mech["pid_ns"] and mech["uid"] == "own":
        _kill_uid(uid)  # what the program left behind: every process of its uid
    end = {
        "exit": os.waitstatus_to_exitcode(status),
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_kb": usage.ru_maxrss,
    }
    os.write(ctl, json.dumps(end).encode() + b"\n")  # second line: how it ended
    os._exit(0)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a process of that uid calling kill(-1) reaches exactly them."""
    import signal

    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    _bootstrap(sys.argv[1:])
    sys.exit(0)


# ================================================================================= parent side

import errno  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import functools  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import logging  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import selectors  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import shutil  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import signal  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import socket  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import subprocess  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import tempfile  # noqa: E402  (parent side: the bootstrap run exits above, without these)
import time  # noqa: E402  (parent side: the bootstrap run exits above, without these)
from dataclasses import asdict, dataclass, field  # noqa: E402  (parent side: the bootstrap run exits above, without these)
from typing import Any  # noqa: E402  (parent side: the bootstrap run exits above, without these)
from collections.abc import Mapping  # noqa: E402  (parent side: the bootstrap run exits above, without these)

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


@dataclass(frozen=True)
class Limits:
    """What one run may use. `memory_mb` caps each process's address space and, where a memory
    cgroup can be made (root), the resident memory of all the run's processes together (plus its
    working directory's tmpfs); `file_size_mb` caps each file and, with a private root, the whole
    working directory (a tmpfs of that size); `output_bytes` caps stdout and stderr each."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    file_size_mb: int = 8
    nproc: int = 32
    nofile: int = 64
    output_bytes: int = 64 << 10
    results_bytes: int = 1 << 20  # fd 3: all of it (a pipe), or each line (a conversation)
    # time the run's processes spent runnable but waiting for a CPU (a loaded machine) moves the wall
    # deadline back, up to this many times wall_s: a correct program that was starved is not a timeout.
    # Off by default: a program can crowd its own CPU with spinning forks and so earn the credit, and
    # a deadline pushed past the reward runner's timeout turns its failure into a reward error (a
    # dropped sample); set it only where (1 + wait_credit) x wall_s stays under that timeout
    wait_credit: float = 0.0


@dataclass
class SandboxResult:
    """How a run ended. `status`: "exited" (see `returncode`), "timeout" (wall or CPU time),
    "output_limit" (stdout/stderr past the cap: killed), "signal" (killed by `signal`, e.g. SIGSEGV
    when an allocation past the memory limit crashes C code), "supervisor_killed" (the bootstrap
    died while the program ran: the program's failure), "protocol" (a line on the conversation's
    fd 3 past `results_bytes`: killed), "setup_error" (the sandbox could not be built: nothing ran)."""

    status: str
    returncode: int | None = None
    signal: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    results: bytes = b""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0
    mechanisms: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    oom_killed: bool = False  # the kernel killed a process of the run at its cgroup's memory limit
    waited_s: float = 0.0  # wall time added to the deadline for the run's processes waiting for a CPU

    @property
    def ok(self) -> bool:
        return self.status == "exited" and self.returncode == 0

    @property
    def memory_error(self) -> bool:
        """The program ran out of its memory limit (Python's MemoryError, C code that crashed on it,
        or the OOM killer at the run's cgroup limit)."""
        return (
            self.oom_killed or b"MemoryError" in self.stderr[-4096:] or self.signal in ("SIGSEGV", "SIGABRT", "SIGBUS")
        )


@functools.lru_cache(maxsize=1)
def _ro_paths() -> tuple[list[str], list[str]]:
    """What the program may read: the system's libraries and binaries, and this interpreter's
    standard library (its site-packages hidden)."""
    import sysconfig

    paths = [p for p in ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin") if os.path.lexists(p)]
    stdlib = sysconfig.get_paths()["stdlib"]
    hidden = []
    for p in (os.path.dirname(stdlib), sysconfig.get_config_var("LIBDIR") or ""):
        if p and not any(p == q or p.startswith(q.rstrip("/") + "/") for q in paths if not os.path.islink(q)):
            paths.append(p)
    for p in (os.path.join(stdlib, "site-packages"), os.path.join(stdlib, "dist-packages")):
        if os.path.isdir(p):
            hidden.append(p)
    return paths, hidden


_CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "TMPDIR": "/work",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
}


def run_python(
    source: str,
    *,
    files: Mapping[str, bytes | str] | None = None,
    stdin: bytes = b"",
    limits: Limits = Limits(),
    isolation: str = "auto",
    tmp_dir: str | None = None,
    converse: Callable[[Channel], None] | None = None,
) -> SandboxResult:
    """Run `source` as `main.py` in the sandbox, with `files` (relative path -> content) in its
    working directory and `stdin` as its standard input.

    `converse`: called with a `Channel` once the program runs; fd 3 is then a socket to it, one line
    each way at a time (the checker of `mcore_rl/rewards/checker.py`); when it returns the program
    reads end-of-file there. Without it fd 3 is a pipe captured as `SandboxResult.results`.

    `isolation`: "auto" (the strongest the kernel allows: namespaces + an own uid when root, a
    user namespace otherwise), "user_ns" (a user namespace even when root), "none" (rlimits, uid,
    seccomp only: for comparison; never for untrusted code)."""
    if isolation not in ("auto", "user_ns", "none"):
        raise ValueError(f"isolation must be 'auto', 'user_ns' or 'none', got {isolation!r}")
    if not sys.platform.startswith("linux"):
        raise OSError(f"the sandbox needs Linux (namespaces, rlimits, seccomp); this is {sys.platform}")
    _remove_orphan_dirs(tmp_dir or tempfile.gettempdir())
    base = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=tmp_dir)  # the owner's pid: see below
    try:
        return _run(base, source, files or {}, stdin, limits, isolation, converse)
    finally:
        shutil.rmtree(base, ignore_errors=True)


_DIR_PREFIX = "mcore-sandbox-"
_SWEPT: set[str] = set()


def _remove_orphan_dirs(parent: str) -> None:
    """Once per process and directory: remove the run directories (the program, its files) that an
    owner killed before its `finally` left behind (a reward worker SIGKILLed at its timeout; the
    worker pool also removes a killed worker's whole temporary directory)."""
    if parent in _SWEPT:
        return
    _SWEPT.add(parent)
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        owner = name[len(_DIR_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _run(
    base: str,
    source: str,
    files: Mapping[str, bytes | str],
    stdin: bytes,
    limits: Limits,
    isolation: str,
    converse: Callable[[Channel], None] | None,
) -> SandboxResult:
    ro, hidden = map(list, _ro_paths())
    os.chmod(base, 0o711)  # traversable by the program's uid (to mount its root on base/root), not listable
    os.mkdir(os.path.join(base, "root"), 0o755)
    os.mkdir(os.path.join(base, "files"), 0o700)
    with open(os.open(os.path.join(base, "stdin"), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(stdin)
    for rel, content in files.items():
        path = os.path.normpath(os.path.join(base, "files", rel))
        if not path.startswith(os.path.join(base, "files") + os.sep):
            raise ValueError(f"a sandbox file must be a relative path inside the working directory, got {rel!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    cgroups = _make_cgroups(os.path.basename(base), limits)
    try:
        with open(os.open(os.path.join(base, "job.json"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            json.dump(
                {
                    "source": source,
                    "limits": asdict(limits),
                    "isolation": isolation,
                    "ro_paths": ro,
                    "hidden_paths": hidden,
                    "cgroups": cgroups,
                },
                f,
            )
        return _launch(base, limits, cgroups, converse)
    finally:
        for cgroup in cgroups:
            _remove_cgroup(cgroup["path"])


_CGROUP_ROOT = "/sys/fs/cgroup/memory"  # cgroup v1's memory controller
_CGROUP_V2: str | None = None  # the cgroup2 mount; None: found in /proc/self/mounts
_CGROUP_DIR = "mcore-rl-sandbox"


def _make_cgroups(name: str, limits: Limits) -> list[dict[str, Any]]:
    """The run's cgroups ({"path", "memory"}), as far as this machine lets us make one: a
    cgroup-v1 memory cgroup (root), else a cgroup-v2 one (root, or a delegated subtree without it)
    that holds every process of the run so that `cgroup.kill` ends them all, capped at the run's
    memory where the v2 memory controller is ours to enable. An empty list: none could be made
    (the PID namespace and the process group still hold the run's processes; docs/sandbox.md)."""
    cap = (limits.memory_mb + limits.file_size_mb) << 20
    out = []
    if os.geteuid() == 0 and os.path.isdir(_CGROUP_ROOT):
        path = _new_cgroup(os.path.join(_CGROUP_ROOT, _CGROUP_DIR), name)
        if path is not None:
            for knob in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
                _write_knob(path, knob, str(cap))
            out.append({"path": path, "memory": True})
    v2 = _cgroup_v2_home() if not out else None  # (a v1 cgroup already holds and kills every process)
    if v2 is not None:
        parent = os.path.join(v2, _CGROUP_DIR)
        path = _new_cgroup(parent, name)
        if path is not None:
            memory = _enable_v2_memory(v2, parent)
            if memory:
                memory = _write_knob(path, "memory.max", str(cap))
                _write_knob(path, "memory.swap.max", "0")
            out.append({"path": path, "memory": memory})
    if not out:
        _warn_once(
            "no cgroup for the run (needs root or a delegated cgroup-v2 subtree): memory is bounded per "
            "process only, and the run's processes are held by its PID namespace and process group"
        )
    elif not any(c["memory"] for c in out):
        _warn_once(
            "no memory cgroup (neither cgroup v1's memory controller nor a v2 one we may enable): memory "
            "is bounded per process only"
        )
    return out


def _cgroup_v2_home() -> str | None:
    """The directory of this process's own cgroup-v2 cgroup, if it is writable."""
    mount = _CGROUP_V2
    if mount is None:
        try:
            with open("/proc/self/mounts") as f:
                mounts = [line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]]
            with open("/proc/self/cgroup") as f:
                own = [line.strip().split(":", 2)[2] for line in f if line.startswith("0::")]
        except (OSError, IndexError):
            return None
        if not mounts or not own:
            return None
        mount = os.path.join(mounts[0], own[0].lstrip("/"))
    return mount if os.access(mount, os.W_OK) else None


def _enable_v2_memory(home: str, parent: str) -> bool:
    """Whether the v2 memory controller can be enabled for the runs' parent cgroup."""
    try:
        with open(os.path.join(home, "cgroup.subtree_control")) as f:
            if "memory" not in f.read().split():
                return False
    except OSError:
        return False
    return _write_knob(parent, "cgroup.subtree_control", "+memory")


def _write_knob(path: str, knob: str, value: str) -> bool:
    try:
        with open(os.path.join(path, knob), "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _new_cgroup(parent: str, name: str) -> str | None:
    path = os.path.join(parent, f"{os.getpid()}-{name}")  # the owner's pid: see `_remove_orphan_cgroups`
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_orphan_cgroups(parent)
        os.mkdir(path)
    except OSError as exc:
        _warn_once(f"no cgroup under {parent} ({exc})")
        return None
    return path


def _remove_orphan_cgroups(parent: str) -> None:
    """Remove the cgroups of runs whose owner died before it could (a reward worker killed at its
    timeout): kill what is still in them, remove them."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        owner = name.split("-", 1)[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}") and os.path.isdir(os.path.join(parent, name)):
            _remove_cgroup(os.path.join(parent, name))


def _remove_cgroup(path: str) -> None:
    """SIGKILL whatever is still in the run's cgroup (`cgroup.kill` where there is one: it also
    catches processes forked meanwhile), then remove it."""
    _write_knob(path, "cgroup.kill", "1")
    deadline = time.monotonic() + 5
    while True:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            pids = []
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:
            logger.warning("sandbox: processes %s of %s did not die", pids, path)
            return
        time.sleep(0.01)
    for _ in range(100):  # the cgroup is busy until its last process is reaped
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                logger.warning("sandbox: could not remove %s: %s", path, exc)
                return
            time.sleep(0.01)
    logger.warning("sandbox: could not remove %s: still busy", path)


def _oom_kills(cgroup: dict[str, Any]) -> int:
    """How many processes the OOM killer took in the cgroup (v1 memory.oom_control, v2 memory.events)."""
    for knob in ("memory.oom_control", "memory.events"):
        try:
            with open(os.path.join(cgroup["path"], knob)) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("sandbox: %s", message)


class Channel:
    """The caller's end of a conversation with the running program (`run_python(converse=...)`):
    one line each way at a time. While it waits for a line it keeps reading the program's stdout
    and stderr and enforces the wall time, so a program that floods or stalls ends the run instead
    of blocking the caller."""

    def __init__(self, watch: _Watch) -> None:
        self._watch = watch

    def send(self, line: bytes) -> bool:
        """Queue `line` (it ends with a newline) for the program; False if the run has ended."""
        return self._watch.send(line)

    def receive(self) -> bytes | None:
        """The program's next line (without the newline), or None: the run ended, timed out, closed
        its end, or sent a line longer than `Limits.results_bytes`."""
        return self._watch.receive()


class _Watch:
    """The caller's side of one run: reads stdout, stderr, the bootstrap's report and fd 3 (a pipe
    it keeps, or a socket a conversation uses), enforces the wall time and the output caps."""

    def __init__(
        self, proc: subprocess.Popen, ctl_r: int, chan: int, conversing: bool, limits: Limits, start: float
    ) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc, self.limits, self.chan, self.conversing = proc, limits, chan, conversing
        self.streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", ctl_r: "ctl", chan: "results"}
        self.caps = {
            "stdout": limits.output_bytes,
            "stderr": limits.output_bytes,
            "ctl": 1 << 20,
            "results": limits.results_bytes,
        }
        self.data = {name: bytearray() for name in self.caps}
        self.killed: str | None = None
        self.start, self.deadline = start, start + limits.wall_s
        self.waited_s = 0.0  # wait for a CPU credited to the deadline so far
        self.exited_at: float | None = None  # when the bootstrap closed its report pipe: it has exited
        self.outgoing = bytearray()
        self.chan_open = True
        self.sel = selectors.DefaultSelector()
        for fd in self.streams:
            self.sel.register(fd, selectors.EVENT_READ)

    def running(self) -> bool:
        return (
            self.killed is None
            and bool(self.sel.get_map())
            and (self.exited_at is None or time.monotonic() - self.exited_at <= 0.2)
        )

    def started(self) -> bool:
        """The program is running: the bootstrap's first report line came without a set-up error."""
        first = bytes(self.data["ctl"]).split(b"\n", 1)
        return len(first) == 2 and b'"setup_error"' not in first[0]

    def step(self) -> None:
        """One round: read what is there (and write what the program is owed), at most 0.1 s."""
        now = time.monotonic()
        if now >= self.deadline and not self._credit_waiting():
            self.killed = "timeout"
            return
        if self.outgoing and self.chan_open:
            self.sel.modify(self.chan, selectors.EVENT_READ | selectors.EVENT_WRITE)
        for key, events in self.sel.select(min(self.deadline - now, 0.1)):
            fd = key.fd
            if events & selectors.EVENT_WRITE:
                try:
                    del self.outgoing[: os.write(fd, self.outgoing)]
                except OSError:  # the program closed its end
                    self.outgoing.clear()
                if not self.outgoing:
                    self.sel.modify(fd, selectors.EVENT_READ)
            if not events & selectors.EVENT_READ:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            name = self.streams[fd]
            if not chunk:
                self.sel.unregister(fd)
                if name == "ctl":
                    self.exited_at = time.monotonic()
                if fd == self.chan:
                    self.chan_open = False
                continue
            room = self.caps[name] - len(self.data[name])
            self.data[name] += chunk[:room]
            if len(chunk) > room and name in ("stdout", "stderr"):
                self.killed = "output_limit"
            elif len(chunk) > room and self.conversing:
                self.killed = "protocol"

    def _credit_waiting(self) -> bool:
        """At the deadline: move it back by the time the run's processes have waited for a CPU since
        the last credit (capped at `wait_credit` x `wall_s` in all); whether it moved. Waiting to be
        scheduled is the machine's doing; sleeping, blocking and computing are the program's, and
        the kernel's accounting (schedstat) tells them apart, so a program cannot earn credit by
        stalling. The credit never exceeds the time that has passed (so a program that forks N
        spinning processes cannot multiply it) nor the cap."""
        elapsed = time.monotonic() - self.start
        waited = min(_runqueue_wait_s(self.proc.pid), elapsed, self.limits.wait_credit * self.limits.wall_s)
        if waited - self.waited_s < 0.01:
            return False
        self.deadline += waited - self.waited_s
        self.waited_s = waited
        return True

    def run(self) -> None:
        while self.running():
            self.step()

    def send(self, line: bytes) -> bool:
        if not self.chan_open or not self.running():
            return False
        self.outgoing += line
        return True

    def receive(self) -> bytes | None:
        while b"\n" not in self.data["results"]:
            if not self.chan_open or not self.running():
                return None
            self.step()
        line, _, rest = bytes(self.data["results"]).partition(b"\n")
        self.data["results"] = bytearray(rest)
        return line

    def close_channel(self) -> None:
        """The conversation is over: the program reads end-of-file on fd 3."""
        if self.chan_open:
            self.sel.unregister(self.chan)
            self.chan_open = False
        try:
            socket.socket(fileno=os.dup(self.chan)).shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _launch(
    base: str, limits: Limits, cgroups: list[dict[str, Any]], converse: Callable[[Channel], None] | None
) -> SandboxResult:
    ctl_r, ctl_w = os.pipe()
    if converse is None:
        chan, chan_w = os.pipe()
    else:
        mine, theirs = socket.socketpair()
        chan, chan_w = mine.detach(), theirs.detach()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-B",
                os.path.abspath(__file__),
                base,
                str(ctl_w),
                str(chan_w),
                str(os.getpid()),
            ],
            env=_CLEAN_ENV,
            cwd=base,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(ctl_w, chan_w),
            start_new_session=True,
        )
    except OSError as exc:
        for fd in (ctl_r, ctl_w, chan, chan_w):
            os.close(fd)
        return SandboxResult("setup_error", error=f"the sandbox could not be started: {exc}")
    os.close(ctl_w)
    os.close(chan_w)
    assert proc.stdout is not None and proc.stderr is not None
    watch = _Watch(proc, ctl_r, chan, converse is not None, limits, start)
    try:
        if converse is not None:
            while watch.running() and b"\n" not in watch.data["ctl"]:
                watch.step()
            if watch.started():
                converse(Channel(watch))
            watch.close_channel()
        watch.run()
    finally:
        watch.sel.close()
        _kill_group(proc)  # not reaped yet, so its pid (the group's id) cannot have been reused
        for fd in (ctl_r, chan):
            os.close(fd)
        proc.stdout.close()
        proc.stderr.close()
    res = _result(
        watch.killed,
        bytes(watch.data["ctl"]),
        bytes(watch.data["stdout"]),
        bytes(watch.data["stderr"]),
        b"" if converse is not None else bytes(watch.data["results"]),
        time.monotonic() - start,
        limits,
    )
    res.waited_s = watch.waited_s
    if res.status == "timeout" and watch.waited_s > 0 and watch.killed == "timeout":
        res.error = f"{res.error} (+{watch.waited_s:.2f}s credited for waiting for a CPU)"
    res.oom_killed = any(_oom_kills(cgroup) > 0 for cgroup in cgroups)
    if res.oom_killed and res.status in ("signal", "supervisor_killed"):
        res.error = f"killed at the {limits.memory_mb + limits.file_size_mb} MiB memory limit of the run"
    if res.mechanisms.get("pid_ns") is False and res.mechanisms.get("uid") == "own":
        _kill_uid_processes(_UID_BASE + proc.pid)  # no PID namespace: what it left may have left the group
    return res


def _kill_uid_processes(uid: int) -> None:
    """SIGKILL every process of the sandbox's own uid, from a process of that uid (kill(-1) as that
    uid reaches exactly them, not the caller). `Popen(user=)`: no fork of this possibly threaded process."""
    try:
        subprocess.run(
            ["kill", "-9", "-1"],
            user=uid,
            group=uid,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("sandbox: could not kill what uid %d left: %s", uid, exc)


def _kill_group(proc: subprocess.Popen) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(proc.pid, signal.SIGKILL)
            break
        except (ProcessLookupError, PermissionError):
            continue
    proc.wait()


def _runqueue_wait_s(root: int) -> float:
    """Seconds the live threads of process `root` and its descendants (the bootstrap and the
    program's PID namespace under it) have spent runnable but not running, summed, from
    /proc/PID/task/TID/schedstat's second field; 0 where the kernel does not keep it. Exited
    processes, and those that left the tree (possible only without a PID namespace), are not
    counted: the credit errs short. (Threads that wait at the same time count each: the caller
    caps the credit at the time that has passed.)"""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])  # after the command name (it may hold spaces)
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    total_ns, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            for task in os.scandir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task.name}/schedstat", "rb") as f:
                    total_ns += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # it exited meanwhile, or no schedstat here
            continue
    return total_ns / 1e9


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _result(
    killed: str | None, ctl: bytes, stdout: bytes, stderr: bytes, results: bytes, wall: float, limits: Limits
) -> SandboxResult:
    report: dict[str, Any] = {}
    for line in ctl.splitlines():
        try:
            report.update(json.loads(line))
        except ValueError:
            report.setdefault("setup_error", f"unreadable report from the sandbox: {line[:200]!r}")
    for warning in report.get("warnings", []):
        _warn_once(warning)
    res = SandboxResult(
        "exited",
        stdout=stdout,
        stderr=stderr,
        results=results,
        wall_s=wall,
        cpu_s=float(report.get("cpu_s", 0.0)),
        max_rss_mb=report.get("max_rss_kb", 0) / 1024,
        mechanisms=report.get("mechanisms", {}),
    )
    code = report.get("exit")
    if killed is not None:
        res.status = killed
        res.error = {
            "timeout": f"ran past the {limits.wall_s:g}s wall-time limit",
            "output_limit": f"wrote more than {limits.output_bytes} bytes to stdout or stderr",
            "protocol": f"sent a line of more than {limits.results_bytes} bytes on fd 3",
        }[killed]
    elif report.get("setup_error"):
        res.status, res.error = "setup_error", f"the sandbox could not be set up: {report['setup_error']}"
    elif code is None and "mechanisms" in report:
        # it reported the program started, then died: whatever killed it (the OOM killer at the
        # run's memory limit, a signal) the program could cause, so the run is the program's failure
        res.status, res.error = "supervisor_killed", "the sandbox's bootstrap was killed while the program ran"
    elif code is None:
        res.status, res.error = "setup_error", "the sandbox's bootstrap died without a report"
    elif code < 0:
        res.signal = _signal_name(-code)
        # RLIMIT_CPU counts whole seconds and rusage is coarse: a SIGKILL near the limit is the limit's
        cpu_out = res.signal == "SIGXCPU" or (res.signal == "SIGKILL" and res.cpu_s >= 0.9 * _cpu_limit(limits.cpu_s))
        res.status = "timeout" if cpu_out else "signal"
        res.error = f"ran past the {limits.cpu_s:g}s CPU-time limit" if cpu_out else f"killed by {res.signal}"
    else:
        res.returncode = code
    return res


def probe(isolation: str = "auto") -> dict[str, Any]:
    """What the sandbox can use on this machine: the `mechanisms` of a trivial run."""
    res = run_python("pass", isolation=isolation)
    return dict(res.mechanisms, status=res.status, error=res.error)
