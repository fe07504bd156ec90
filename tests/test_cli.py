"""The `mcore-rl` command as a user meets it, in real subprocesses: help and config errors come
without importing torch, megatron-core or transformers; an expected fatal error is one line and its
documented exit code (its traceback only with `--debug` / MCORE_RL_DEBUG=1)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from mcore_rl.cli import EXIT_BAD_INPUT, EXIT_ENGINES_LOST, EXPECTED_ERRORS, expected_exit_code
from tests.helpers import SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
SFT_DEMO = os.path.join(ROOT, "configs", "sft_demo.yaml")
HEAVY = ("torch", "megatron", "transformers")


def _cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: str = ROOT, importtime: bool = False
) -> subprocess.CompletedProcess:
    python = [sys.executable, *(["-X", "importtime"] if importtime else [])]
    return subprocess.run(
        [*python, "-m", "mcore_rl.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=ROOT, MCORE_RL_PROGRESS="0", **(env or {})),
    )


def _imported(stderr: str) -> set[str]:
    """The top-level packages a `python -X importtime` run imported."""
    return {
        line.split("|")[2].strip().split(".")[0]
        for line in stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["sft", "--help"],
        ["train", "--help"],
        ["profile", "--help"],
        ["convert", "--help"],
        ["launch", "--help"],
        ["plot", "--help"],
        ["train", DEMO, "model.hiden_size=63"],  # a typo: the loader's error
        ["sft", SFT_DEMO, "model.hidden_size=63"],  # a rule of the model: the validator's error
    ],
    ids=lambda a: " ".join(os.path.basename(w) for w in a),
)
def test_help_and_config_errors_import_nothing_heavy(args):
    run = _cli(*args, importtime=True)
    heavy = _imported(run.stderr) & set(HEAVY)
    assert not heavy, f"`mcore-rl {' '.join(args)}` imported {sorted(heavy)}"
    assert run.returncode == (0 if "--help" in args else EXIT_BAD_INPUT), run.stderr[-2000:]


def test_help_lists_every_command_and_the_exit_codes():
    run = _cli("--help")
    assert run.returncode == 0
    for command in ("sft", "train", "serve", "convert", "profile", "plot", "parity", "diagnose", "launch"):
        assert command in run.stdout
    assert "exit codes:" in run.stdout and "75" in run.stdout and "--debug" in run.stdout


def test_every_listed_error_is_an_exception_class():
    """The table names classes rather than importing them: a renamed or moved class fails here."""
    for name in EXPECTED_ERRORS:
        module, _, cls = name.rpartition(".")
        found = getattr(importlib.import_module(module), cls, None)
        assert isinstance(found, type) and issubclass(found, BaseException), name
    from mcore_rl.rollout.router import NoHealthyEngine
    from mcore_rl.runtime.scheduler import EnginesLost

    assert expected_exit_code(NoHealthyEngine("x")) == expected_exit_code(EnginesLost("x")) == EXIT_ENGINES_LOST
    assert expected_exit_code(KeyError("a bug")) is None


def test_a_config_error_is_one_line_and_its_traceback_is_there_with_debug():
    run = _cli("sft", SFT_DEMO, "model.hiden_size=63")
    assert run.returncode == EXIT_BAD_INPUT and "Traceback" not in run.stderr
    assert run.stderr.startswith("mcore-rl sft: override 'model.hiden_size=63': unknown config key"), run.stderr
    for debug in (["--debug"], []):
        run = _cli(*debug, "sft", SFT_DEMO, "model.hiden_size=63", env={} if debug else {"MCORE_RL_DEBUG": "1"})
        assert run.returncode == EXIT_BAD_INPUT and "Traceback" in run.stderr and "ConfigError" in run.stderr
        assert run.stderr.rstrip().splitlines()[-1].startswith("mcore-rl sft: override"), run.stderr


def test_engines_lost_is_one_line_and_exit_code_3(tmp_path):
    """The asynchronous runtime with its only engine at an address nothing listens on: the pool gives
    up (NoHealthyEngine / EnginesLost), and the user reads one line, not 30 through asyncio."""
    run = _cli(
        "train",
        *SMALL,
        "rollout.runtime=async",
        "rollout.engine_urls=[http://127.0.0.1:9]",
        "rollout.no_engine_timeout_s=2",
        "init.sft_steps=0",
        f"run_dir={tmp_path}/run",
        timeout=600,
        cwd=str(tmp_path),
    )
    assert run.returncode == EXIT_ENGINES_LOST, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.rstrip().splitlines()[-1]
    assert last.startswith("mcore-rl train: ") and "engine" in last, last
