"""Fake `sbatch`, `srun` and `scontrol` for testing launch/slurm.sbatch on one machine.

`install(bin_dir)` writes three executables; put `bin_dir` first on PATH. Each appends what it was
asked to do (argv, and the environment variables the launch scripts set) to `$FAKE_SLURM_LOG` as
one JSON line. They behave like the real ones as far as the scripts rely on them:

- `sbatch --wait [--nodes N] [--gpus-per-node G] SCRIPT ARGS`: runs SCRIPT with bash as the batch
  shell, in a job environment (SLURM_JOB_ID, SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST,
  SLURM_GPUS_ON_NODE, SLURM_SUBMIT_DIR, SLURM_CPUS_PER_TASK; defaults from the `#SBATCH` lines),
  writes the batch shell's pid to `$FAKE_SLURM_DIR/batch.pid` and exits with its exit code.
- `scontrol show hostnames LIST`: the nodes of `$FAKE_SLURM_HOSTS` (comma-separated; loopback
  addresses 127.0.0.N make distinct nodes that all resolve to this machine); `requeue JOB` is recorded.
- `srun --nodes=N ... CMD ...`: runs N tasks of CMD locally (SLURM_NODEID/SLURM_PROCID 0..N-1) when
  CMD mentions one of the words in `$FAKE_SRUN_RUN` (e.g. "torchrun.sh"), else only records it.
  Like srun it passes SIGTERM/SIGUSR1/SIGUSR2/SIGINT on to its tasks and exits with the highest code.
  With `$FAKE_SRUN_WAIT_FOR` set, an srun whose command lacks that word first waits (up to 60 s) until
  one that has it is recorded: a background srun the batch shell kills once the trainer's srun returns
  (the engines) is then recorded whatever the load, as a real long-running one would be.
"""

from __future__ import annotations

import os
import stat
import sys

_COMMON = r"""
import json, os, re, signal, subprocess, sys

RECORDED_ENV = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC", "RDZV_ID", "ENGINE_URLS", "ENGINE_PORTS",
                "ENGINE_GPUS", "ENGINE_MODEL", "ROUTER", "ROUTER_PORT", "SLURM_JOB_ID")


def record(tool, argv):
    with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
        f.write(json.dumps({"tool": tool, "argv": argv, "env": {k: os.environ.get(k) for k in RECORDED_ENV}}) + "\n")
"""

_SBATCH = (
    _COMMON
    + r"""
argv = sys.argv[1:]
record("sbatch", argv)
opts, i = {}, 0
while i < len(argv) and argv[i].startswith("--"):
    key, _, value = argv[i][2:].partition("=")
    if not value and key != "wait":
        i += 1
        value = argv[i]
    opts[key] = value
    i += 1
script, args = argv[i], argv[i + 1:]
for line in open(script):
    m = re.match(r"#SBATCH --([\w-]+)=(\S+)", line)
    if m:
        opts.setdefault(m.group(1), m.group(2))
nodes = int(opts.get("nodes", 1))
hosts = os.environ["FAKE_SLURM_HOSTS"].split(",")[:nodes]
env = dict(os.environ, SLURM_JOB_ID=os.environ.get("FAKE_SLURM_JOB_ID", "4242"), SLURM_JOB_NUM_NODES=str(nodes),
           SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=",".join(hosts),
           SLURM_GPUS_ON_NODE=opts.get("gpus-per-node", "8"),
           SLURM_SUBMIT_DIR=os.getcwd(), SLURM_CPUS_PER_TASK=opts.get("cpus-per-task", "1"))
proc = subprocess.Popen(["bash", script, *args], env=env)
with open(os.path.join(os.environ["FAKE_SLURM_DIR"], "batch.pid"), "w") as f:
    f.write(str(proc.pid))
sys.exit(proc.wait())
"""
)

_SRUN = (
    _COMMON
    + r"""
argv = sys.argv[1:]
record("srun", argv)
wait_for = os.environ.get("FAKE_SRUN_WAIT_FOR", "")  # an srun started in the background before this one
if wait_for and wait_for not in " ".join(argv):
    import time

    deadline = time.monotonic() + 60
    while wait_for not in open(os.environ["FAKE_SLURM_LOG"]).read() and time.monotonic() < deadline:
        time.sleep(0.05)
opts, i = {}, 0
while i < len(argv) and argv[i].startswith("--"):
    key, _, value = argv[i][2:].partition("=")
    opts[key] = value
    i += 1
command = argv[i:]
if not any(word and word in " ".join(command) for word in os.environ.get("FAKE_SRUN_RUN", "").split()):
    sys.exit(0)
tasks = [subprocess.Popen(command, env=dict(os.environ, SLURM_NODEID=str(n), SLURM_PROCID=str(n),
                                            SLURMD_NODENAME=host))
         for n, host in enumerate(opts["nodelist"].split(",")[: int(opts["nodes"])])]


def forward(signum, frame):
    for t in tasks:
        if t.poll() is None:
            t.send_signal(signum)


for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
    signal.signal(sig, forward)
codes = [t.wait() for t in tasks]
sys.exit(max(c if c >= 0 else 128 - c for c in codes))
"""
)

_SCONTROL = (
    _COMMON
    + r"""
argv = sys.argv[1:]
record("scontrol", argv)
if argv[:2] == ["show", "hostnames"]:
    wanted = set(argv[2].split(","))
    print("\n".join(h for h in os.environ["FAKE_SLURM_HOSTS"].split(",") if h in wanted))
"""
)


def install(bin_dir: str) -> None:
    os.makedirs(bin_dir, exist_ok=True)
    for name, body in (("sbatch", _SBATCH), ("srun", _SRUN), ("scontrol", _SCONTROL)):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f"#!{sys.executable}\n{body}")
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
