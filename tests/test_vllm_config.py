"""`rollout.engine_kind: vllm` without a vLLM server: what the validation refuses, the client's
pure translations of SGLang's fields, and the cores a started server's processes get (the server
tests are in test_vllm_engine.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.config.rl_vllm import VLLM_READY_STAMP
from mcore_rl.rollout.vllm_client import prompt_logprobs, vllm_request_id, vllm_sampling_params
from mcore_rl.rollout.vllm_processes import split_two_cores

VLLM = [
    "rollout.engine_kind=vllm",
    "rollout.sync_transport=disk",
    "rollout.sync_dir=/tmp/weights",
    "rollout.vllm_python=/bin/sh",  # any existing file: the venv itself is not needed to validate
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.ffn_hidden_size=128",
    "model.num_layers=2",
    "rollout.max_new_tokens=4",
    "train.seq_length=32",
    "init.sft_steps=0",
]


def problems(*overrides: str) -> str:
    try:
        validate_rl_config(load_config(RLConfig, None, [*VLLM, *overrides]), 1)
    except ConfigError as err:
        return str(err)
    return ""


def test_a_cpu_vllm_config_validates() -> None:
    assert problems() == ""


@pytest.mark.filterwarnings("ignore:rollout.top_p/top_k truncate")
@pytest.mark.parametrize(
    "override, key, reason",
    [
        ("rollout.sync_transport=tensor", "rollout.sync_transport", "no in-memory push"),
        ("rollout.placement=colocated", "rollout.placement", "frees no memory"),
        ("rollout.pause_mode=retract", "rollout.pause_mode", "recomputes in-flight"),
        ("rollout.quantization=fp8", "rollout.quantization", "not on CPU"),
        ("rollout.top_p=0.9", "rollout.top_p/top_k", "temperature-scaled full distribution"),
        ("rollout.top_k=5", "rollout.top_p/top_k", "temperature-scaled full distribution"),
        ("model.num_attention_heads=4", "model.kv_channels", "head dim 16"),
        ("rollout.vllm_python=/nonexistent/python", "rollout.vllm_python", "setup_vllm.sh"),
        ("rollout.sync_dir=null", "rollout.sync_dir", "directory the engines can read"),
    ],
)
def test_what_vllm_cannot_do_on_cpu_is_refused_naming_the_key(override: str, key: str, reason: str) -> None:
    found = [line for line in problems(override).splitlines() if line.strip().startswith(key + ":")]
    assert any(reason in line for line in found), problems(override)


def test_the_nccl_transfer_needs_an_accelerator_and_gpu_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sync_transport: distributed` is vLLM's NCCL transfer (`rollout/vllm_weights.py`): refused
    without CUDA, and for the engines the trainer starts (vLLM's CPU build)."""
    import torch

    def lines(key: str) -> list[str]:
        found = problems("rollout.sync_transport=distributed").splitlines()
        return [line for line in found if line.strip().startswith(key + ":")]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert any("needs an accelerator" in line for line in lines("rollout.sync_transport"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert lines("rollout.sync_transport") == []
    assert any("CPU build" in line for line in lines("rollout.engine_urls"))
    urls = "rollout.engine_urls=[http://127.0.0.1:1]"
    assert problems("rollout.sync_transport=distributed", urls) == ""


def test_vllm_python_only_applies_to_vllm_engines() -> None:
    err = "\n".join(line for line in problems("rollout.engine_kind=sglang").splitlines() if "vllm_python" in line)
    assert "only applies with rollout.engine_kind: vllm" in err


def test_sampling_params_map_to_vllm_names_and_stop_at_eos() -> None:
    sp = {"temperature": 0.7, "max_new_tokens": 5, "sampling_seed": 3, "top_p": 1.0, "stop_token_ids": [9]}
    assert vllm_sampling_params(sp, 258) == {
        "temperature": 0.7,
        "max_tokens": 5,
        "seed": 3,
        "top_p": 1.0,
        "stop_token_ids": [9, 258],
    }
    assert "stop_token_ids" not in vllm_sampling_params({"ignore_eos": True}, 258)
    with pytest.raises(ValueError, match="sampling_params.stop:"):
        vllm_sampling_params({"stop": ["\n"]}, 258)


def test_prompt_logprobs_in_sglang_shape() -> None:
    reply = [None, {"5": {"logprob": -1.0}}, {"6": {"logprob": -2.0}}, {"7": {"logprob": -3.0}}]
    assert prompt_logprobs([4, 5, 6, 7], reply, 0) == [
        [None, 4, None],
        [-1.0, 5, None],
        [-2.0, 6, None],
        [-3.0, 7, None],
    ]
    assert prompt_logprobs([4, 5, 6, 7], reply, 2) == [[None, 6, None], [-3.0, 7, None]]
    with pytest.raises(ValueError, match="expected 4 entries"):
        prompt_logprobs([4, 5, 6, 7], reply[:2], 0)
    assert vllm_request_id("r1") == "cmpl-r1-0"


def _setup(venv: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "setup_vllm.sh")
    env = {**os.environ, "MCORE_RL_VLLM_VENV": venv}
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env, timeout=60)


def test_setup_reuses_a_complete_venv_of_its_variant_and_never_turns_one_into_the_other(tmp_path) -> None:
    """`tools/setup_vllm.sh [--gpu]` without a network: a stamped venv whose interpreter passes the
    checks is reused (no pip); one of the other variant is refused, never converted."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n')  # every check passes
    python.chmod(0o755)
    (venv / VLLM_READY_STAMP).write_text("cpu\n")
    reused = _setup(str(venv))
    assert reused.returncode == 0 and "reusing" in reused.stdout and "(cpu," in reused.stdout
    assert "pip" not in (venv / "bin" / "calls").read_text()
    assert "torch.version.cuda is None" in (venv / "bin" / "calls").read_text()  # the CPU build checked
    refused = _setup(str(venv), "--gpu")
    assert refused.returncode == 1 and "holds the cpu variant, not gpu" in refused.stderr
    (venv / VLLM_READY_STAMP).write_text("gpu\n")
    assert "(gpu," in _setup(str(venv), "--gpu").stdout
    assert "torch.version.cuda, " in (venv / "bin" / "calls").read_text()  # the CUDA build checked
    assert _setup(str(venv), "--bogus").returncode == 2


# a server (the session's leader) with a child as vLLM's EngineCore, each with a second thread
_TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import threading, time; "
    "threading.Thread(target=time.sleep, args=(600,), daemon=True).start(); print(flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def _affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t)) for t in sorted(os.listdir(f"/proc/{pid}/task"))]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_on_two_cores_the_api_server_gets_one_and_the_rest_of_its_session_the_other() -> None:
    """`split_two_cores` (why: its docstring): every thread moves, and a server on another number
    of cores is left as it is."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    for cores, want_leader, want_child in (((a, b), {b}, {a}), ((b,), {b}, {b})):
        leader = subprocess.Popen(
            [sys.executable, "-c", _TREE],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores),
        )
        try:
            child = int(leader.stdout.readline())  # type: ignore[union-attr]
            deadline = time.monotonic() + 30
            while len(os.listdir(f"/proc/{child}/task")) < 2 or len(os.listdir(f"/proc/{leader.pid}/task")) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert split_two_cores(leader.pid) is (len(cores) == 2)
            assert _affinities(leader.pid) == [want_leader] * len(_affinities(leader.pid))
            assert _affinities(child) == [want_child] * len(_affinities(child))
        finally:
            os.killpg(leader.pid, 9)
            leader.wait()
