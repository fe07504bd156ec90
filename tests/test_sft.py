"""`mcore-rl sft` end to end: the command a user runs, on its own processes."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_demo_recipe_loss_falls(tmp_path):
    run = _cli(
        "sft",
        "configs/sft_demo.yaml",
        f"run_dir={tmp_path}",
        "train.train_iters=60",
        "train.log_interval=20",
        "train.eval_interval=60",
        "data.synthetic_max_digits=1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 61))
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert "eval_loss" in records[-1] and "eval_accuracy" in records[-1]
    assert "addition accuracy after training" in run.stdout
    assert os.path.exists(tmp_path / "config.yaml")


@pytest.mark.slow
def test_two_ranks_tensor_parallel_bf16_recompute_jsonl(tmp_path):
    """Relaunch under torchrun, TP=2 with SP, bf16, full recompute, a jsonl file with a bad line."""
    data = tmp_path / "data.jsonl"
    good = [{"prompt": f"q{i}?", "response": f"answer {i}."} for i in range(40)]
    lines = [json.dumps(x) for x in good[:20]] + ["{not json"] + [json.dumps(x) for x in good[20:]]
    data.write_text("\n".join(lines) + "\n")
    run = _cli(
        "sft",
        f"run_dir={tmp_path}/run",
        f"data.path={data}",
        "data.on_bad_line=skip",
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "train.precision=bf16",
        "train.recompute=full",
        "train.train_iters=12",
        "train.seq_length=32",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "--nproc-per-node",
        "2",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{data}:21" in run.stderr + run.stdout  # the bad line is reported with file:line
    records = _metrics(f"{tmp_path}/run")
    assert len(records) == 12 and records[-1]["loss"] < records[0]["loss"]


def test_bad_config_fails_before_launch_naming_the_key(tmp_path):
    run = _cli("sft", "train.micro_batchsize=3", "--nproc-per-node", "2", timeout=60)
    assert run.returncode == 2
    assert "train.micro_batchsize" in run.stderr and "micro_batch_size" in run.stderr
    run = _cli("sft", "parallel.tensor_model_parallel_size=3", "--nproc-per-node", "2", timeout=60)
    assert run.returncode == 2 and "parallel.tensor_model_parallel_size" in run.stderr
    run = _cli("sft", "train.precision=fp8", timeout=60)
    assert run.returncode == 2 and "train.precision" in run.stderr and "bf16" in run.stderr


def test_bad_data_line_is_fatal_by_default(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": 1}\n')
    run = _cli("sft", f"run_dir={tmp_path}/run", f"data.path={data}", "train.train_iters=1", timeout=120)
    assert run.returncode != 0
    assert f"{data}:2" in run.stderr


def test_missing_paths_are_named(tmp_path):
    run = _cli("sft", f"run_dir={tmp_path}/run", f"data.tokenizer_path={tmp_path}/no_tok", timeout=120)
    assert run.returncode != 0 and f"{tmp_path}/no_tok" in run.stderr
    run = _cli("sft", f"run_dir={tmp_path}/run", f"checkpoint.load_dir={tmp_path}/no_ckpt", timeout=120)
    assert run.returncode != 0 and f"{tmp_path}/no_ckpt" in run.stderr


TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "train.seq_length=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "data.synthetic_num_examples=64",
    "train.train_iters=1",
]


def _cli_on_tmpfs(mount: str, options: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`_cli(*args)` in a private mount namespace with a tmpfs (`-o options`) at `mount`: real
    read-only and full filesystems. Needs root (or user namespaces); skips where the sandbox refuses."""
    os.makedirs(mount, exist_ok=True)
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o {options} tmpfs {shlex.quote(mount)}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    command = shlex.join([sys.executable, "-m", "mcore_rl.cli", *args])
    script = f"mount -t tmpfs -o {options} tmpfs {shlex.quote(mount)} && exec {command}"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_unwritable_save_dir_fails_before_training(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    run = _cli("sft", *TINY, f"run_dir={tmp_path}/run", f"checkpoint.save_dir={a_file}/ckpt", timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"checkpoint.save_dir: cannot write to '{a_file}/ckpt'" in run.stderr and "Not a directory" in run.stderr
    run = _cli("sft", *TINY, f"run_dir={tmp_path}/run", f"checkpoint.save_dir={a_file}", timeout=120)
    assert run.returncode == 2 and f"checkpoint.save_dir: '{a_file}' is a file, not a directory" in run.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # no step ran


def test_read_only_save_dir_fails_before_training(tmp_path):
    ro = str(tmp_path / "ro")
    run = _cli_on_tmpfs(ro, "ro,size=64k", "sft", *TINY, f"run_dir={tmp_path}/run", f"checkpoint.save_dir={ro}/ckpt")
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"checkpoint.save_dir: cannot write to '{ro}/ckpt': Read-only file system" in run.stderr
    assert "step" not in run.stdout  # no training step ran


def test_full_disk_at_save_says_so_and_where(tmp_path):
    full = str(tmp_path / "full")
    run = _cli_on_tmpfs(full, "size=256k", "sft", *TINY, f"run_dir={tmp_path}/run", f"checkpoint.save_dir={full}/ckpt")
    assert run.returncode == 1, run.stderr[-3000:]
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith(
        f"mcore-rl sft: could not write checkpoint {full}/ckpt/iter_0000001: the disk holding "
        f"checkpoint.save_dir '{full}/ckpt' is full"
    ), run.stderr[-3000:]
    assert f"mounted at {full})" in message and "Traceback" not in run.stderr


def test_data_errors_come_before_any_worker_starts(tmp_path):
    """A bad line fails in the command itself, before torchrun and distributed initialisation."""
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "c"}\n')
    run = _cli(
        "sft",
        *TINY,
        "train.global_batch_size=4",
        f"run_dir={tmp_path}/run",
        f"data.path={data}",
        "--nproc-per-node",
        "2",
        timeout=60,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1].startswith(f"mcore-rl sft: {data}:2: not valid UTF-8")
    assert "torch.distributed" not in run.stderr and "Traceback" not in run.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "1+1="}\n\xff\n')
    run = _cli("train", f"run_dir={tmp_path}/rl", f"data.path={prompts}", timeout=60)
    assert run.returncode == 2 and run.stderr.splitlines()[-1].startswith(
        f"mcore-rl train: {prompts}:2: not valid UTF-8"
    )
    run = _cli("train", f"run_dir={tmp_path}/rl", f"data.path={tmp_path}/none.jsonl", timeout=60)
    assert run.returncode == 2 and f"data.path: no such file: {tmp_path}/none.jsonl" in run.stderr
