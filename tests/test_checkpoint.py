"""Distributed checkpoints: an interrupted run resumes exactly; a checkpoint loads in other layouts."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.world import run_world
from tests.helpers import TINY_SFT, _env, _latest_step, _start_trainer

pytestmark = pytest.mark.slow


def _cfg(run_dir: str, iters: int, parallel: dict, **checkpoint):
    from mcore_rl.config import SFTConfig, load_config

    overrides = [
        f"run_dir={run_dir}",
        f"train.train_iters={iters}",
        "train.log_interval=100",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.seq_length=32",
        "data.synthetic_num_examples=512",
        "model.num_layers=4",
        "optimizer.lr=3e-3",
        "optimizer.lr_warmup_iters=2",
    ]
    overrides += [f"parallel.{k}={v}" for k, v in parallel.items()]
    overrides += [f"checkpoint.{k}={v}" for k, v in checkpoint.items()]
    return load_config(SFTConfig, None, overrides)


def _weights(trainer):
    from mcore_rl.models.shards import gather_full_state_dict

    return gather_full_state_dict(trainer.chunks)


def _resume_world(rank: int, world_size: int, tmp: str) -> None:
    import torch

    from mcore_rl.train import sft

    tp2 = {"tensor_model_parallel_size": 2, "sequence_parallel": "true"}
    # Uninterrupted: 6 steps.
    full = [r["loss"] for r in sft.run_sft(_cfg(f"{tmp}/a", 6, tp2))]
    # Interrupted after 3 steps (checkpoint), then resumed to 6 in the same layout.
    sft.run_sft(_cfg(f"{tmp}/b", 3, tp2, save_dir=f"{tmp}/ckpt"))
    assert os.path.exists(f"{tmp}/ckpt/latest")
    resumed = [r["loss"] for r in sft.run_sft(_cfg(f"{tmp}/c", 6, tp2, load_dir=f"{tmp}/ckpt"))]
    assert len(resumed) == 3
    assert resumed == full[3:], (resumed, full[3:])  # bit-identical: same layout, same RNG

    # The same checkpoint in other layouts: identical weights, the same next loss (fp32 noise only).
    reference = sft.build_trainer(_cfg(f"{tmp}/d", 6, tp2, load_dir=f"{tmp}/ckpt"))
    ref_weights, ref_step = _weights(reference), sft.train_step(reference)["loss"]
    assert ref_step == full[3]
    for layout in (
        {"pipeline_model_parallel_size": 2},
        {},
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    ):
        trainer = sft.build_trainer(_cfg(f"{tmp}/e", 6, layout, load_dir=f"{tmp}/ckpt"))
        weights = _weights(trainer)
        assert set(weights) == set(ref_weights)
        for key, value in ref_weights.items():
            assert torch.equal(weights[key], value), (layout, key)
        loss = sft.train_step(trainer)["loss"]
        assert abs(loss - ref_step) <= 1e-5 * abs(ref_step), (layout, loss, ref_step)
        # Optimizer moments, scheduler and data position came along: the second step agrees too.
        second = sft.train_step(trainer)["loss"]
        assert abs(second - full[4]) <= 1e-5 * abs(full[4]), (layout, second, full[4])


def test_resume_and_reshard(tmp_path):
    run_world(2, _resume_world, str(tmp_path))


def test_missing_checkpoint_names_the_path(tmp_path):
    from mcore_rl.train.checkpoint import latest_checkpoint

    with pytest.raises(FileNotFoundError, match="nowhere"):
        latest_checkpoint(str(tmp_path / "nowhere"))
    assert latest_checkpoint(str(tmp_path)) is None


# ------------------------------------------------------------------ a killed trainer leaves nothing behind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline) of every process, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        table[int(name)] = (int(stat[1]), stat[0], cmdline)
    return table


def _descendants(pid: int) -> dict[int, str]:
    table, out, todo = _proc_table(), {}, [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _, cmdline) in table.items():
            if ppid == parent and child not in out:
                out[child] = cmdline
                todo.append(child)
    return out


def _alive(pids) -> dict[int, str]:
    table = _proc_table()
    return {p: table[p][2] for p in pids if p in table and table[p][1] not in ("Z", "X")}


def _kill_and_expect_no_survivors(
    proc: subprocess.Popen, log: str, wait_for: str, after: str, timeout: float = 240
) -> None:
    """Once the file `after` exists and a descendant whose command line contains `wait_for` runs,
    SIGKILL `proc` by pid and assert that every process it had started is gone within seconds."""
    kids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + timeout
        while not (os.path.exists(after) and any(wait_for in c for c in kids.values())):
            assert proc.poll() is None, f"trainer exited early (rc {proc.returncode}):\n{open(log).read()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"no {wait_for!r} process after {timeout} s:\n{open(log).read()[-3000:]}"
            )
            time.sleep(0.5)
            kids = _descendants(proc.pid)
        kids = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(kids) == {}, f"left behind by the killed trainer: {_alive(kids)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _alive(kids):  # only what this test started, by pid
            os.kill(pid, signal.SIGKILL)


def test_sigkill_of_the_trainer_takes_the_checkpoint_writer_along(tmp_path):
    proc, log = _start_trainer(
        tmp_path,
        "sft",
        f"run_dir={tmp_path}/run",
        "train.train_iters=100000",
        f"checkpoint.save_dir={tmp_path}/ckpt",
        "checkpoint.save_interval=1",
        *TINY_SFT,
    )
    # killed after a complete save, with megatron-core's writer processes started
    _kill_and_expect_no_survivors(proc, log, wait_for="multiprocessing.spawn", after=f"{tmp_path}/ckpt/latest")


def test_sigkill_of_the_command_stops_the_torchrun_relaunch(tmp_path):
    proc, log = _start_trainer(
        tmp_path,
        "sft",
        f"run_dir={tmp_path}/run",
        "train.train_iters=100000",
        f"checkpoint.save_dir={tmp_path}/ckpt",
        "checkpoint.save_interval=1",
        *TINY_SFT,
        "--nproc-per-node",
        "2",
    )
    # torchrun, both ranks and each rank's writer processes: all gone with the command
    _kill_and_expect_no_survivors(proc, log, wait_for="multiprocessing.spawn", after=f"{tmp_path}/ckpt/latest")


def test_sigkill_during_a_save_leaves_a_resumable_latest_and_no_writer(tmp_path):
    """Killed while megatron-core's forked writers are writing shards (a model big enough that a
    save takes a while): they die too, and `latest` still names a complete checkpoint."""
    model = [
        "model.num_layers=2",
        "model.hidden_size=256",
        "model.ffn_hidden_size=1024",
        "train.log_interval=1000",
        "train.seq_length=16",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "data.synthetic_num_examples=64",
    ]
    ckpt = f"{tmp_path}/ckpt"
    proc, log = _start_trainer(
        tmp_path,
        "sft",
        f"run_dir={tmp_path}/run",
        "train.train_iters=100000",
        *model,
        f"checkpoint.save_dir={ckpt}",
        "checkpoint.save_interval=1",
    )
    # forked writers carry the trainer's command line
    _kill_and_expect_no_survivors(proc, log, wait_for="mcore_rl.cli sft", after=f"{ckpt}/latest")
    step = _latest_step(ckpt)
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_rl.cli",
            "sft",
            f"run_dir={tmp_path}/run",
            *model,
            f"train.train_iters={step + 1}",
            f"checkpoint.load_dir={ckpt}",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt}/iter_{step:07d} at iteration {step}" in resumed.stdout


# ------------------------------------------------------------------ a signal to the trainer's process group

_GROUP_SIGNAL = r"""
import json, os, signal, time
from multiprocessing import popen_spawn_posix

from mcore_rl.parallel import cpu_compat


def main():
    cpu_compat.apply()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mcore_rl.parallel.preemption import preemption_guard
    from mcore_rl.train import checkpoint

    launch = popen_spawn_posix.Popen._launch

    def launch_then_signal(self, process_obj):  # the manager runs, its first Python line has not
        launch(self, process_obj)
        os.killpg(0, signal.SIGUSR1)

    with preemption_guard(["SIGTERM", "SIGUSR1"]) as guard:
        popen_spawn_posix.Popen._launch = launch_then_signal
        try:
            checkpoint._writers_die_with_trainer()
        finally:
            popen_spawn_posix.Popen._launch = launch
        queue, manager = filesystem_async._results_queue, checkpoint._writer_manager._process
        queue.put("started")
        for sig in (signal.SIGUSR1, signal.SIGTERM):  # and once it serves
            os.killpg(0, sig)
        time.sleep(0.5)
        queue.put("signalled")
        got = [queue.get(), queue.get()]
        print(json.dumps({"got": got, "manager": [manager.is_alive(), manager.exitcode],
                          "received": guard.received, "repeats": guard.repeats}))


if __name__ == "__main__":
    main()
"""


def test_the_writer_manager_survives_a_signal_to_the_trainer_s_process_group():
    """torchrun passes SIGUSR1 on with os.killpg, to a rank's helpers too, and one node's torchrun may
    do it after another node's rank made every rank stop and save: the manager serving megatron-core's
    write-results queue, started for that save, died of it (default action) and the rank's next call
    to the queue raised EOFError (exit 1, no requeue). Sent while the manager starts and once it serves."""
    proc = subprocess.run(
        [sys.executable, "-c", _GROUP_SIGNAL],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own process group: the signals stay in it
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["got"] == ["started", "signalled"] and out["manager"] == [True, None], out
    assert out["received"] == signal.SIGUSR1 and out["repeats"] == 2, out  # the trainer's guard got all three


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kill_between_metrics_and_save(
    proc: subprocess.Popen, log: str, metrics: str, save_dir: str, timeout: float = 240
) -> int:
    """SIGKILL `proc` at a moment when `metrics` holds steps its newest checkpoint does not (frozen
    with SIGSTOP to check, so the moment is certain); returns the last step logged."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"trainer ended before the kill (rc {proc.returncode}):\n{open(log).read()[-3000:]}"
        assert time.monotonic() < deadline, open(log).read()[-3000:]
        if _latest_step(save_dir) > 0 and os.path.exists(metrics):
            os.kill(proc.pid, signal.SIGSTOP)
            steps = [r["step"] for r in _read_jsonl(metrics)]
            if steps and steps[-1] > _latest_step(save_dir) > 0:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return steps[-1]
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.02)


def test_sft_resume_after_a_kill_logs_each_step_once(tmp_path):
    """A kill after step s was logged but before it was saved: the resumed run's metrics.jsonl has
    every step once, with the numbers of a run that was never interrupted."""
    args = ["sft", *TINY_SFT, "train.train_iters=40", "train.log_interval=5"]
    full = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", *args, f"run_dir={tmp_path}/full"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    ckpt, metrics = f"{tmp_path}/ckpt", f"{tmp_path}/run/metrics.jsonl"
    proc, log = _start_trainer(
        tmp_path, *args, f"run_dir={tmp_path}/run", f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=15"
    )
    logged = _kill_between_metrics_and_save(proc, log, metrics, ckpt)
    assert logged > _latest_step(ckpt)
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_rl.cli",
            *args,
            f"run_dir={tmp_path}/run",
            f"checkpoint.save_dir={ckpt}",
            f"checkpoint.load_dir={ckpt}",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    measured = ("tokens_per_s", "time/", "perf/", "ttfs/")  # wall-clock figures (observe/)

    def timeless(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(measured)} for r in records]

    got = _read_jsonl(metrics)
    assert [r["step"] for r in got] == list(range(1, 41))
    assert timeless(got) == timeless(_read_jsonl(f"{tmp_path}/full/metrics.jsonl"))


def test_a_full_disk_is_named_whatever_the_writer_says(tmp_path, monkeypatch):
    """The message path of a full disk without mounting one (tests/test_sft.py fills a real tmpfs)."""
    import shutil

    from mcore_rl.train import checkpoint

    worker = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    path = checkpoint.checkpoint_dir(str(tmp_path), 7)
    usage = shutil._ntuple_diskusage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(1 << 40, (1 << 40) - 4096, 4096))
    err = checkpoint._disk_full(str(tmp_path), path, worker)
    assert isinstance(err, checkpoint.CheckpointError)
    assert f"could not write checkpoint {path}: the disk holding checkpoint.save_dir '{tmp_path}' is full" in str(err)
    assert "4.0 KiB free of 1.0 TiB" in str(err) and "on the filesystem mounted at /" in str(err)
    # plenty of space left: not a full disk, the original error stands ...
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 39, 1 << 39))
    assert checkpoint._disk_full(str(tmp_path), path, worker) is None
    # ... unless the writer's cause says ENOSPC
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as cause:
            raise RuntimeError("write failed") from cause
    except RuntimeError as chained:
        assert "is full" in str(checkpoint._disk_full(str(tmp_path), path, chained))
