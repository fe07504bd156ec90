"""Cluster launch (docs/launch.md): the scripts parse, explain themselves and reject bad input before
starting anything; pre-emption signals, sent for real by pid, make `mcore-rl train` checkpoint, exit
75 and resume; launch/slurm.sbatch, with fake sbatch/srun/scontrol (tests/fake_slurm.py), places the
trainer and the engines and, running launch/torchrun.sh on two loopback "nodes" (torchrun --nnodes=2,
c10d), passes SIGUSR1 on to the ranks, requeues and resumes; `mcore-rl launch --dry-run` prints the plan."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN_SH = os.path.join(REPO, "launch", "torchrun.sh")
SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(PYTHON=sys.executable, **env)
    return subprocess.run(["bash", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", [TORCHRUN_SH, SBATCH, os.path.join(REPO, "launch", "engines.sh")])
def test_scripts_parse(script):
    proc = _run("-n", script)
    assert proc.returncode == 0, proc.stderr


def test_torchrun_usage_without_args():
    proc = _run(TORCHRUN_SH)
    assert proc.returncode == 2
    assert proc.stdout == ""
    usage = proc.stderr
    assert usage.startswith("usage:")
    for word in (
        "RECIPE.yaml",
        "NNODES",
        "NODE_RANK",
        "NPROC",
        "MASTER_ADDR",
        "MASTER_PORT",
        "--rdzv-backend c10d",
        "-m mcore_rl.cli MODE",
        "[sft|train]",
        "SIGUSR1",
        "DRY_RUN",
    ):
        assert word in usage, word


def test_torchrun_help_goes_to_stdout():
    proc = _run(TORCHRUN_SH, "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage:")


def test_torchrun_rejects_bad_input_before_launching():
    recipe = "configs/sft_demo.yaml"
    proc = _run(TORCHRUN_SH, "configs/missing.yaml")
    assert proc.returncode == 2 and "recipe not found" in proc.stderr
    proc = _run(TORCHRUN_SH, recipe, NNODES="2", NODE_RANK="2")
    assert proc.returncode == 2 and "NODE_RANK" in proc.stderr
    proc = _run(TORCHRUN_SH, recipe, NPROC="two")
    assert proc.returncode == 2 and "NPROC" in proc.stderr
    # The config is checked for world size NNODES * NPROC = 2 (TP=4 does not fit), naming the key.
    proc = _run(TORCHRUN_SH, recipe, "parallel.tensor_model_parallel_size=4", NPROC="2")
    assert proc.returncode == 2
    assert "world size 2" in proc.stderr and "parallel.tensor_model_parallel_size" in proc.stderr
    assert "torchrun.sh: node" not in proc.stderr  # torchrun never started


# ------------------------------------------------------------------ pre-emption: real signals, real resume


def _rl_args(tmp_path, *extra: str) -> list[str]:
    """A tiny `mcore-rl train` (tests/test_rl_loop.py's TINY, no warm start or evaluation: only steps)."""
    from tests.helpers import TINY

    return [
        "train",
        *TINY,
        "init.sft_steps=0",
        "eval.interval=0",
        "eval.at_start=false",
        "logging.plot=false",
        "logging.tensorboard=false",
        f"run_dir={tmp_path}/run",
        f"checkpoint.save_dir={tmp_path}/ckpt",
        *extra,
    ]


def _wait_for(proc: subprocess.Popen, log: str, done, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"trainer exited (rc {proc.returncode}) before {what}:\n{open(log).read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{open(log).read()[-3000:]}"
        time.sleep(0.02)


def _rl_steps(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["rl_step"] for line in f if line.endswith("\n")]


@pytest.mark.slow
def test_sigterm_and_sigusr1_checkpoint_exit_75_and_the_run_resumes(tmp_path):
    """SIGTERM by pid once a step is done: the trainer finishes its step, saves, exits 75. The resumed
    run continues from that checkpoint; SIGUSR1 stops it the same way, and a second signal while it
    saves is ignored. Every rollout step is logged once. (A checkpoint written under a second signal
    resumes to the end in the SLURM test below.)"""
    from mcore_rl.parallel.preemption import EXIT_PREEMPTED, read_marker
    from tests.helpers import _latest_step, _start_trainer

    ckpt, run_dir = f"{tmp_path}/ckpt", f"{tmp_path}/run"
    proc, log = _start_trainer(tmp_path, *_rl_args(tmp_path, "train.num_steps=50"))
    try:
        _wait_for(proc, log, lambda: _rl_steps(run_dir)[-1:] >= [1], "a finished step")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=240) == EXIT_PREEMPTED, open(log).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    first = _latest_step(ckpt)
    out = open(log).read()
    assert first >= 1 and f"pre-empted by SIGTERM after step {first}: checkpoint {ckpt}/iter_{first:07d}" in out, out
    assert read_marker(run_dir)["step"] == first and read_marker(run_dir)["signal"] == "SIGTERM"
    assert _rl_steps(run_dir)[-1] == first  # it stopped at the step it saved

    # resumed; SIGUSR1 after one more step, and SIGTERM again once the checkpoint's directory appears
    proc, log = _start_trainer(tmp_path, *_rl_args(tmp_path, "train.num_steps=50", f"checkpoint.load_dir={ckpt}"))
    try:
        _wait_for(proc, log, lambda: _rl_steps(run_dir)[-1:] > [first], "a step after the resume")
        os.kill(proc.pid, signal.SIGUSR1)
        _wait_for(
            proc,
            log,
            lambda: any(int(d[5:]) > first for d in os.listdir(ckpt) if d.startswith("iter_")),
            "the new checkpoint",
        )
        os.kill(proc.pid, signal.SIGTERM)  # during the save
        assert proc.wait(timeout=240) == EXIT_PREEMPTED, open(log).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    second = _latest_step(ckpt)
    out = open(log).read()
    assert f"resumed from {ckpt}/iter_{first:07d} at rollout step {first}" in out, out
    assert "got SIGTERM again while stopping: ignored" in out, out
    assert second > first and f"pre-empted by SIGUSR1 after step {second}" in out, out

    assert second in _rl_steps(run_dir) and _rl_steps(run_dir)[-1] == second
    opt = _rl_steps(run_dir).count(1)  # optimizer steps per rollout step
    assert _rl_steps(run_dir) == [s for s in range(1, second + 1) for _ in range(opt)]  # each step once


# ------------------------------------------------------------------ SLURM, with fake sbatch/srun/scontrol


def _slurm_env(tmp_path, **env: str) -> dict[str, str]:
    from tests import fake_slurm

    fake_slurm.install(str(tmp_path / "bin"))
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(
        PATH=f"{tmp_path}/bin{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_LOG=f"{tmp_path}/slurm.jsonl",
        FAKE_SLURM_DIR=str(tmp_path),
        FAKE_SLURM_HOSTS="127.0.0.1,127.0.0.2,127.0.0.3",
        PYTHON=sys.executable,
        PYTHONPATH=REPO,
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        **env,
    )
    return full


def _calls(tmp_path, tool: str) -> list[dict]:
    with open(f"{tmp_path}/slurm.jsonl") as f:
        return [c for c in map(json.loads, f) if c["tool"] == tool]


def test_sbatch_puts_trainer_and_engines_on_their_nodes(tmp_path):
    """`train` on 3 nodes with ENGINE_NODES=1: the engine srun on the last node, the trainer srun on
    the first two with the rendezvous on the first and the servers' URLs as rollout.engine_urls.
    (Nothing runs: the fake srun only records.) An allocation too small for the plan fails, naming numbers."""
    env = _slurm_env(
        tmp_path,
        ENGINE_NODES="1",
        ENGINE_MODEL="/models/policy",
        ENGINE_WAIT_S="0",
        ENGINES_PER_NODE="2",
        MASTER_PORT="29511",
        FAKE_SRUN_WAIT_FOR="engines.sh",
    )
    proc = subprocess.run(
        ["sbatch", "--wait", "--nodes", "3", SBATCH, "train", "configs/demo.yaml", f"run_dir={tmp_path}/run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    calls = _calls(tmp_path, "srun")  # started in the background, recorded in either order
    assert len(calls) == 2
    engines, trainer = sorted(calls, key=lambda c: not c["argv"][-1].endswith("launch/engines.sh"))
    assert engines["argv"][:2] == ["--nodes=1", "--nodelist=127.0.0.3"]
    assert engines["argv"][-1].endswith("launch/engines.sh")
    urls = ["http://127.0.0.3:30000", "http://127.0.0.3:30001"]
    assert engines["env"]["ENGINE_PORTS"] == "30000 30001" and engines["env"]["ENGINE_GPUS"] == "0,1,2,3 4,5,6,7"
    assert engines["env"]["ENGINE_URLS"] == " ".join(urls) and engines["env"]["ENGINE_MODEL"] == "/models/policy"
    assert trainer["argv"][:2] == ["--nodes=2", "--nodelist=127.0.0.1,127.0.0.2"]
    assert "--kill-on-bad-exit=1" in trainer["argv"]
    command = trainer["argv"][trainer["argv"].index("bash") :]
    assert command[3:6] == [TORCHRUN_SH, "train", "configs/demo.yaml"], command
    assert command[-1] == f"rollout.engine_urls=[{','.join(urls)}]"  # the trainer's own EngineRouter spreads them
    assert {k: trainer["env"][k] for k in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC", "RDZV_ID")} == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "NNODES": "2",
        "NPROC": "8",
        "RDZV_ID": "4242",
    }
    assert "trainer 2 node(s) [127.0.0.1,127.0.0.2] x 8" in proc.stdout + proc.stderr

    # one node, asked for an engine node and 16 ranks per node: the plan fails before any srun
    os.remove(f"{tmp_path}/slurm.jsonl")
    proc = subprocess.run(
        ["sbatch", "--wait", "--nodes", "1", SBATCH, "train", "configs/demo.yaml"],
        cwd=REPO,
        env=dict(env, NPROC="16"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        "the SLURM allocation (job 4242: 1 node(s) x 8 GPU(s)) cannot hold this plan: it needs 2 node(s) "
        "(1 trainer + 1 engine) but the allocation has 1; it needs 16 GPU(s) per trainer node"
    ) in proc.stderr
    assert _calls(tmp_path, "srun") == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sft_steps(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


@pytest.mark.slow
def test_two_node_torchrun_under_sbatch_usr1_checkpoints_requeues_and_resumes(tmp_path):
    """The multi-node path on one machine: the fake srun starts launch/torchrun.sh on two "nodes"
    (127.0.0.1 and 127.0.0.2), i.e. two torchrun processes of one rank each meeting at a c10d
    rendezvous on loopback, running a tiny SFT. SIGUSR1 to the batch shell goes batch shell -> srun ->
    torchrun.sh -> torchrun -> both ranks: they save after the same step (a SIGTERM meanwhile is not
    passed on) and the job exits 75 and requeues itself. The requeued job resumes from that
    checkpoint and runs to completion."""
    from mcore_rl.parallel.preemption import EXIT_PREEMPTED
    from tests.helpers import TINY_SFT, _latest_step

    ckpt, run_dir = f"{tmp_path}/ckpt", f"{tmp_path}/run"
    env = _slurm_env(tmp_path, FAKE_SRUN_RUN="torchrun.sh", MASTER_PORT=str(_free_port()))
    args = [
        "sbatch",
        "--wait",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        SBATCH,
        "sft",
        "configs/sft_demo.yaml",
        *TINY_SFT,
        f"run_dir={run_dir}",
        f"checkpoint.save_dir={ckpt}",
        "train.eval_interval=0",
    ]
    log = open(f"{tmp_path}/job1.log", "w")
    job = subprocess.Popen([*args, "train.train_iters=100000"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(job, log.name, lambda: len(_sft_steps(run_dir)) >= 2, "two SFT steps")
        with open(f"{tmp_path}/batch.pid") as f:
            batch_shell = int(f.read())
        os.kill(batch_shell, signal.SIGUSR1)
        _wait_for(job, log.name, lambda: os.path.isdir(ckpt) and os.listdir(ckpt), "the checkpoint")
        os.kill(batch_shell, signal.SIGTERM)  # SLURM's SIGTERM while the trainer saves: not passed on
        assert job.wait(timeout=240) == EXIT_PREEMPTED, open(log.name).read()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
    out = open(log.name).read()
    step = _latest_step(ckpt)
    assert step >= 2 and _sft_steps(run_dir)[-1] == step, out[-4000:]
    assert "slurm.sbatch: got SIGUSR1, passing it on to the trainer" in out
    assert "slurm.sbatch: got SIGTERM again while the trainer stops (SIGUSR1 passed on): ignored" in out
    assert out.count("torchrun.sh: got SIGUSR1, passing it on to torchrun") == 2, out[-4000:]
    assert f"pre-empted by SIGUSR1 after step {step}" in out
    assert [c["argv"] for c in _calls(tmp_path, "scontrol")][-1] == ["requeue", "4242"]
    trainer = _calls(tmp_path, "srun")[-1]
    assert trainer["env"]["NNODES"] == "2" and trainer["env"]["NPROC"] == "1"

    # the requeued job: the same command (the plan adds checkpoint.load_dir), to completion
    done = subprocess.run(
        [*args, f"train.train_iters={step + 2}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"resumed from {ckpt}/iter_{step:07d} at iteration {step}" in done.stdout
    assert _calls(tmp_path, "srun")[-1]["argv"][-1] == f"checkpoint.load_dir={ckpt}"
    assert _sft_steps(run_dir) == list(range(1, step + 3))  # every step once


# ------------------------------------------------------------------ mcore-rl launch --dry-run


def test_dry_run_plan_for_two_nodes_of_eight_gpus(capsys, monkeypatch, tmp_path):
    """2 trainer nodes x 8 GPUs (TP=2, PP=2, EP=2 on the MoE demo) plus an engine node of two
    servers: every rank's groups as megatron-core forms them, the rendezvous, the engines, the
    trainer's override. Nothing starts. A SLURM allocation too small for it: the numbers, named."""
    from megatron.core.parallel_state import RankGenerator

    from mcore_rl.cli import main

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    args = [
        "launch",
        "--dry-run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--engine-nodes",
        "1",
        "--engines-per-node",
        "2",
        "--engine-model",
        "/models/policy",
        "--hosts",
        "a,b,c",
        "train",
        "configs/demo_moe.yaml",
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.expert_model_parallel_size=2",
        "parallel.sequence_parallel=true",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "trainer: 2 node(s) x 8 rank(s) = world size 16 on a, b" in out
    assert "layout: TP=2 PP=2 VPP=- CP=1 DP=4 | EP=2 ETP=2 EDP=2" in out
    assert "rendezvous: c10d at a:29500" in out
    assert "http://c:30000  GPUs 0,1,2,3 (TP 4)" in out and "http://c:30001  GPUs 4,5,6,7 (TP 4)" in out
    assert "trainer overrides: rollout.engine_urls=[http://c:30000,http://c:30001]" in out
    rows = {int(line.split()[0]): line.split() for line in out.splitlines()[-16:]}
    assert sorted(rows) == list(range(16))
    # the columns are megatron-core's own groups (order tp-cp-ep-dp-pp): TP pairs, PP = r and r+8, ...
    assert rows[0][1:4] == ["0", "a", "0"] and rows[9][1:4] == ["1", "b", "1"]
    assert rows[5][4:] == ["4,5", "5,13", "1,3,5,7", "5", "5,7", "4,5", "1,5"]
    dense = RankGenerator(tp=2, ep=1, dp=4, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for r in range(16):
        assert rows[r][6] == ",".join(map(str, next(g for g in dense.get_ranks("dp") if r in g)))
    assert json.loads(main(args + ["--json"]) == 0 and capsys.readouterr().out)["world_size"] == 16

    # inside an allocation of 2 nodes x 4 GPUs: 3 nodes of 8 needed
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "the SLURM allocation (job 77: 2 node(s) x 4 GPU(s)) cannot hold this plan: it needs 3 node(s) "
        "(2 trainer + 1 engine) but the allocation has 2; it needs 8 GPU(s) per trainer node "
        "(--nproc-per-node) but the allocation has 4 per node"
    ) in err
    # a layout the world cannot hold names the key
    monkeypatch.delenv("SLURM_JOB_ID")
    assert (
        main(
            [
                "launch",
                "--dry-run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "6",
                "sft",
                "configs/sft_demo.yaml",
                "parallel.tensor_model_parallel_size=4",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "world size 6 (1 node(s) x 6 rank(s))" in err and "parallel.tensor_model_parallel_size" in err
    assert main(["launch", "sft", "configs/sft_demo.yaml"]) == 2  # plans only
    assert "only plans (--dry-run)" in capsys.readouterr().err


# ------------------------------------------------------------------ pre-emption: the agreement, and bad input


def _agree_world(rank: int, world_size: int) -> None:
    from mcore_rl.parallel.preemption import preemption_guard, stop_requested

    with preemption_guard(["SIGTERM", "SIGUSR1"]) as guard:
        decisions = []
        for step in range(4):
            if step == 2 and rank == 1:  # the signal reaches one rank only, between two step boundaries
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGTERM)  # and again: ignored
            decisions.append(stop_requested())
        assert decisions == [None, None, "SIGUSR1", "SIGUSR1"], (rank, decisions)
        assert (guard.received, guard.repeats) == ((signal.SIGUSR1, 1) if rank == 1 else (None, 0))
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # restored


@pytest.mark.slow
def test_ranks_agree_on_the_step_when_only_one_got_the_signal():
    from tests.world import run_world

    run_world(2, _agree_world)


def test_preempt_signals_are_checked_before_anything_starts():
    from mcore_rl.config import ConfigError, RLConfig, SFTConfig, load_config, validate_rl_config, validate_sft_config

    with pytest.raises(ConfigError) as err:
        validate_sft_config(load_config(SFTConfig, None, ["checkpoint.preempt_signals=[SIGTERM,SIGFOO,SIGKILL]"]), 1)
    assert "checkpoint.preempt_signals: 'SIGFOO' is not a signal name" in str(err.value)
    assert "checkpoint.preempt_signals: SIGKILL cannot be used" in str(err.value)
    with pytest.raises(ConfigError, match="checkpoint.preempt_signals: lists a signal twice"):
        validate_rl_config(load_config(RLConfig, None, ["checkpoint.preempt_signals=[SIGUSR1,SIGUSR1]"]), 1)
    validate_rl_config(load_config(RLConfig, None, ["checkpoint.preempt_signals=[]"]), 1)  # off


_MARKER_WRITER = """
import sys
from mcore_rl.parallel.preemption import write_marker
for i in range(int(sys.argv[2])):
    write_marker(sys.argv[1], {"step": i, "signal": "SIGUSR1", "checkpoint": None, "phases": {"save": 0.5}})
"""


def test_the_marker_is_never_read_half_written_while_other_nodes_write_it(tmp_path):
    """Two nodes sharing a run directory both write `preempted.json` while each node's launcher reads
    it (a CI run failed so: a launcher read the other node's half-written marker and exited 1, not 75).
    Two writer processes rewrite it in a loop; once it exists the reader must find it whole every time."""
    from mcore_rl.parallel.preemption import read_marker, write_marker

    run_dir = str(tmp_path)
    write_marker(run_dir, {"step": 0, "signal": "SIGUSR1", "checkpoint": None, "phases": {}})
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _MARKER_WRITER, run_dir, "3000"], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}
        )
        for _ in range(2)
    ]
    reads = missed = 0
    try:
        while any(w.poll() is None for w in writers):
            reads += 1
            missed += read_marker(run_dir) is None
    finally:
        for w in writers:
            w.kill() if w.poll() is None else None
    assert [w.returncode for w in writers] == [0, 0]
    assert reads > 100 and missed == 0, f"{missed} of {reads} reads found no whole marker"
    assert os.listdir(run_dir) == ["preempted.json"]  # no temporary file left behind
