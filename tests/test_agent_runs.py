"""An environment domain through `mcore-rl train` in both schedules, and its config checks.

Both schedules run each episode as one coroutine through the scheduler's `produce_group`: the
synchronous one on the embedded engine, the asynchronous one on started `mcore-rl serve` processes,
its turns continued across weight syncs. Both train only at the model's tokens and count the episodes
in `accounting.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.world import run_world

ENV_RUN = [
    "train.num_steps=2",
    "train.seq_length=128",
    "train.micro_batch_size=8",
    "rollout.quantization=none",
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "rollout.max_new_tokens=60",
    "rollout.request_timeout_s=30",
    "algorithm.num_minibatches=1",
    "optimizer.lr=1e-3",
    "eval.interval=0",
    "eval.at_start=false",
    "eval.num_prompts=4",
    "eval.k=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]


def env_config(run_dir: str, *overrides: str, trajectory: str = "conversation"):
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.rl_schema import DomainConfig, DomainEvalConfig, EnvironmentConfig

    cfg = load_config(RLConfig, None, [f"run_dir={run_dir}", *ENV_RUN, *overrides])
    env = EnvironmentConfig(
        name="guess_number",
        options={"lo": 1, "hi": 8, "max_guesses": 3},
        max_turns=3,
        max_tokens_per_turn=4,
        trajectory=trajectory,  # type: ignore[arg-type]  # one of the schema's two literals
        memory_k=1,
    )
    cfg.data.domains = [DomainConfig(name="guess", environment=env, eval=DomainEvalConfig(num_prompts=4))]
    return cfg


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "episode/count" in line]


def _runs(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.config.rl_validate import validate_rl_config
    from mcore_rl.runtime import run_rl

    # synchronous: 2 prompts x 4 episodes a step, one sample each; the held-out evaluation plays
    # episodes too (scored by the environment: the random model's invalid guesses cost their penalty;
    # a reward function would fail on these prompts and give the error reward, 0)
    cfg = env_config(f"{tmp}/sync", "eval.at_start=true")
    cfg.data.domains[0].environment.invalid_penalty = 0.5
    validate_rl_config(cfg, 1)
    summary = run_rl(cfg)
    with open(os.path.join(f"{tmp}/sync", "metrics.jsonl")) as f:
        first_eval = next(r for r in map(json.loads, f) if "eval/guess/greedy_reward" in r)
    assert first_eval["eval/guess/greedy_reward"] < 0, first_eval
    recs = _records(f"{tmp}/sync")
    assert len(recs) == 2 and all(r["episode/count"] == 8 and r["episode/samples"] == 8 for r in recs)
    assert all(r["episode/template_drift"] == 0 for r in recs)  # ChatML is append-only
    acc = summary["accounting"]
    assert acc["balanced"] and acc["trained"] == 4 and acc["episodes_trained"] == 16
    assert acc["episode_samples_trained"] == 16

    # step-wise, mixed with a single-turn task domain in one batch: a sample per step, each knowing
    # its episode and step; the task's groups generated and scored as before. The SFT warm start
    # trains on the task's answers and on the environment's scripted player (binary search): the
    # random model's greedy guesses are invalid (penalty 0.5 each, as above), the warm-started
    # model's first evaluation has none
    from mcore_rl.config.rl_schema import DomainConfig, DomainEvalConfig

    warm = ["init.sft_steps=120", "init.sft_seq_length=128", "init.sft_micro_batch_size=16", "eval.at_start=true"]
    cfg = env_config(f"{tmp}/stepwise", "data.mixture.sampling=interleave", *warm, trajectory="stepwise")
    assert cfg.data.domains[0].environment is not None
    cfg.data.domains[0].environment.invalid_penalty = 0.5
    cfg.data.domains[0].environment.options["player"] = "middle"
    add = DomainConfig(name="add", task="addition", options={"max_digits": 1}, max_new_tokens=8)
    add.eval = DomainEvalConfig(num_prompts=4)
    cfg.data.domains.append(add)
    validate_rl_config(cfg, 1)
    summary = run_rl(cfg)
    with open(os.path.join(f"{tmp}/stepwise", "metrics.jsonl")) as f:
        first_eval = next(r for r in map(json.loads, f) if "eval/guess/greedy_reward" in r)
    assert first_eval["eval/guess/greedy_reward"] >= 0, first_eval
    recs = _records(f"{tmp}/stepwise")
    assert all(r["episode/count"] == 4 and r["episode/samples"] == 4 * r["episode/turns_mean"] for r in recs)
    assert all("reward/add/mean" in r and "reward/guess/mean" in r for r in recs)
    assert summary["accounting"]["episodes_trained"] == 8 and summary["accounting"]["trained"] == 4

    # asynchronous, one version of staleness: started engine processes, the episodes' turns run while
    # the learner trains; every trained sample's oldest token within the bound
    cfg = env_config(f"{tmp}/async", "rollout.runtime=async", "rollout.max_staleness=1", "train.num_steps=3")
    summary = run_rl(cfg)
    recs = _records(f"{tmp}/async")
    assert len(recs) == 3 and all(r["episode/count"] == 8 for r in recs)
    assert all(r["rollout/policy_version_min"] >= r["rl_step"] - 2 for r in recs if "rl_step" in r)
    acc = summary["accounting"]
    assert acc["balanced"] and acc["failed"] == 0 and acc["trained"] == 6 and acc["episodes_trained"] == 24


def test_environment_domains_train_in_both_schedules(tmp_path):
    run_world(1, _runs, str(tmp_path))


def test_environment_config_errors_name_the_key(tmp_path):
    from mcore_rl.config.rl_validate import validate_rl_config
    from mcore_rl.config.errors import ConfigError

    def errors(cfg) -> str:
        try:
            validate_rl_config(cfg, 1)
        except ConfigError as err:
            return str(err)
        return ""

    cfg = env_config(str(tmp_path))
    assert errors(cfg) == ""
    env = cfg.data.domains[0].environment
    assert env is not None
    env.name = "no_such_env"
    assert "data.domains[0].environment.name: unknown environment 'no_such_env'" in errors(cfg)
    env.name, env.options = "guess_number", {"colour": 1}
    assert "data.domains[0].environment.options: domain 'guess': environment 'guess_number' has no option 'colour'" in (
        errors(cfg)
    )
    env.options, env.tool_format = {}, "llama3_json"
    assert (
        "data.domains[0].environment.tool_format: domain 'guess': 'llama3_json' is not the tool-call format of the "
        "bundled byte tokenizer (ChatML) (its format: 'hermes')"
    ) in errors(cfg)
    env.tool_format, env.max_tokens_per_turn = "hermes", 0
    assert "data.domains[0].environment.max_tokens_per_turn: domain 'guess': must be >= 1, got 0" in errors(cfg)
    env.max_tokens_per_turn, env.max_turns = 500, 0
    msg = errors(cfg)
    assert "environment.max_turns: domain 'guess': must be >= 1" in msg
    assert "environment.max_tokens_per_turn: domain 'guess': 500 is more than the episode's whole budget" in msg
    env.max_tokens_per_turn, env.max_turns = 4, 3
    cfg.data.domains[0].task = "addition"
    assert "domain 'guess': an environment domain draws its environment's prompts; drop ['task']" in errors(cfg)


ENV_YAML = """
data:
  domains:
    - name: guess
      environment:
        name: guess_number
        options: {lo: 1, hi: 8, max_guesses: 3}
        max_turns: 3
        max_tokens_per_turn: 4
      eval: {num_prompts: 4}
"""


@pytest.mark.slow
def test_a_sigkilled_learner_reruns_its_in_flight_episodes_and_loses_none(tmp_path):
    """`mcore-rl train` with an environment domain, asynchronous at staleness 1, SIGKILLed once its
    step-2 checkpoint exists and started again from it: the episodes in flight at the kill are run
    again from their initial state, the buffered ones come back, every step trains its groups once."""
    from tests.helpers import _finish, _kill_after_checkpoint

    tmp = str(tmp_path)
    recipe = os.path.join(tmp, "env.yaml")
    with open(recipe, "w") as f:
        f.write(ENV_YAML)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def train(*extra: str) -> subprocess.Popen:
        args = [sys.executable, "-m", "mcore_rl.cli", "train", recipe, *ENV_RUN, "train.num_steps=4"]
        args += [f"run_dir={tmp}/run", f"checkpoint.save_dir={tmp}/ckpt", "checkpoint.save_interval=1"]
        args += ["rollout.runtime=async", "rollout.max_staleness=1", *extra]
        env = dict(os.environ, PYTHONPATH=root)
        return subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    _kill_after_checkpoint(train(), f"{tmp}/ckpt", 2)
    _finish(train(f"checkpoint.load_dir={tmp}/ckpt"))
    acc = json.load(open(f"{tmp}/run/accounting.json"))
    assert acc["balanced"] and acc["trained"] == 4 * 2 and acc["failed"] == 0
    assert acc["resent_after_resume"] + acc["restored_buffered"] > 0  # step 3's groups were ahead at the kill
    steps = [json.loads(x) for x in open(f"{tmp}/run/metrics.jsonl")]
    assert [r["rl_step"] for r in steps if "time/step_s" in r] == [1, 2, 3, 4]
    assert all(r["episode/count"] == 8 for r in steps if "time/step_s" in r)
