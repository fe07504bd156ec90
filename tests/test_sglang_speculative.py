"""`rollout.speculative_*` on SGLang engine nodes (`config/speculative.py`, the launch plan, `launch/engines.sh`).

The mapping to SGLang's flag names per algorithm; the keys only SGLang serves refused for the
embedded engine, naming the key; a cluster plan with engine nodes hands the flags to the servers
(`ENGINE_SPEC_ARGS`) and a trainer config without speculation of its own that validates; and the
real `launch/engines.sh` starts a (recording) SGLang server with exactly those flags.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.config.speculative import sglang_speculative_flags
from mcore_rl.parallel.launch_plan import LaunchRequest, emit_shell, make_plan
from tests.helpers import rl, rl_errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = "rollout.speculative_algorithm"


def test_flags_of_each_algorithm() -> None:
    assert sglang_speculative_flags(rl().rollout) == []
    assert sglang_speculative_flags(rl(f"{SPEC}=ngram", "rollout.speculative_num_steps=3").rollout) == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "3",
        "--speculative-num-draft-tokens",
        "4",
    ]
    assert sglang_speculative_flags(rl(f"{SPEC}=nextn", "rollout.speculative_num_steps=1").rollout) == [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "1",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "2",
    ]
    eagle = rl(
        f"{SPEC}=eagle3",
        "rollout.speculative_num_steps=3",
        "rollout.speculative_eagle_topk=4",
        "rollout.speculative_num_draft_tokens=8",
        "rollout.speculative_draft_model_path=/drafts/eagle3",
    ).rollout
    assert sglang_speculative_flags(eagle) == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "8",
        "--speculative-draft-model-path",
        "/drafts/eagle3",
    ]


def test_sglang_only_keys_are_refused_for_the_embedded_engine() -> None:
    errors = rl_errors(rl(f"{SPEC}=eagle", "rollout.speculative_draft_model_path=/d"))
    assert any(e.startswith("rollout.speculative_algorithm: eagle drafts only on SGLang engine nodes") for e in errors)
    errors = rl_errors(rl(f"{SPEC}=ngram", "rollout.speculative_eagle_topk=2"))
    assert any(e.startswith("rollout.speculative_eagle_topk: the embedded engine drafts a chain") for e in errors)
    errors = rl_errors(rl(f"{SPEC}=ngram", "rollout.speculative_num_draft_tokens=3"))
    assert "rollout.speculative_num_draft_tokens: a chain (speculative_eagle_topk 1) verifies " in errors[0]


def _plan(*overrides: str):
    req = LaunchRequest(
        "train", nnodes=1, nproc_per_node=2, engine_nodes=1, gpus_per_node=1, engine_model="/m", hosts=["a", "b"]
    )
    return make_plan(req, None, list(overrides), groups=False)


def test_a_plan_with_engine_nodes_hands_them_the_flags() -> None:
    plan = _plan(
        f"{SPEC}=eagle",
        "rollout.speculative_num_steps=3",
        "rollout.speculative_eagle_topk=2",
        "rollout.speculative_draft_model_path=/drafts/my eagle",
    )
    assert plan.engine_spec_args[:2] == ["--speculative-algorithm", "EAGLE"]
    assert plan.engine_spec_args[-2:] == ["--speculative-draft-model-path", "/drafts/my eagle"]
    assert "rollout.speculative_algorithm=none" in plan.trainer_overrides  # the trainer builds no drafting engine
    shell = dict(line.split("=", 1) for line in emit_shell(plan).splitlines() if not line.endswith(")"))
    assert shlex.split(shlex.split(shell["ENGINE_SPEC_ARGS"])[0]) == plan.engine_spec_args
    with pytest.raises(ConfigError, match="rollout.speculative_draft_model_path: eagle3 needs a draft model"):
        _plan(f"{SPEC}=eagle3")
    with pytest.raises(ConfigError, match="rollout.speculative_schedule: dspark is the embedded engine's"):
        _plan(f"{SPEC}=nextn", "rollout.speculative_schedule=dspark")
    with pytest.raises(ConfigError, match=r"rollout.speculative_num_draft_tokens: must be in \[2, .* = 7\], got 9"):
        _plan(
            f"{SPEC}=eagle",
            "rollout.speculative_draft_model_path=/d",
            "rollout.speculative_num_steps=3",
            "rollout.speculative_eagle_topk=2",
            "rollout.speculative_num_draft_tokens=9",
        )
    assert _plan().engine_spec_args == []


def test_engines_sh_starts_sglang_with_the_flags(tmp_path) -> None:
    """The real script, with an interpreter that has "sglang" and records each server's argv."""
    record = tmp_path / "argv"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == -c ]]; then exit 0; fi\n'  # `import sglang` succeeds
        f'printf "%s\\n" "$@" >> {record}; echo --- >> {record}\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/drafts/my eagle"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PYTHON=str(fake),
        ENGINE_PORTS="30000 30001",
        ENGINE_GPUS="0 1",
        ENGINE_MODEL="/models/policy",
        ENGINE_SPEC_ARGS=shlex.join(spec),
        ROUTER="mcore-rl",
    )
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "launch", "engines.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    servers = [block.strip("\n").split("\n") for block in record.read_text().split("---\n") if block.strip()]
    assert len(servers) == 2
    for argv in servers:
        assert argv[:2] == ["-m", "sglang.launch_server"]
        assert argv[-len(spec) :] == spec and "--tp-size" in argv
