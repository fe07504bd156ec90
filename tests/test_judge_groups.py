"""Judge groups (`judges:`): a judge reward names a group (`judge: <name>`) instead of one `url`;
the group is running servers or `mcore-rl serve` processes the trainer starts on a checkpoint, the
same engine-group settings as rollout engines, teachers and the explorer. Calls take turns over the
group's servers and pass over one that cannot be reached; a group the config does not define, or a
head with both a `url` and a `judge`, is refused before anything starts."""

from __future__ import annotations

import os
import socket

import pytest

from mcore_rl.config import RLConfig, load_config
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rl_schema import DomainConfig, JudgeConfig, RewardHeadConfig
from mcore_rl.config.rl_validate import validate_rl_config
from mcore_rl.rewards import RewardInput, RewardRunner
from mcore_rl.rewards.judge import judge_reward_fn
from tests.helpers import ScriptedJudge, save_tiny_hf_model


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once it is closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_calls_take_turns_over_the_group_and_pass_over_a_dead_server(tmp_path) -> None:
    a = ScriptedJudge(tmp_path, [["resp", "Score: 7"]])
    b = ScriptedJudge(tmp_path, [["resp", "Score: 7"]])
    dead = _dead_url()
    try:
        fn = judge_reward_fn("llm_judge", url=[a.url, dead, b.url])
        with RewardRunner(fn, max_concurrency=1) as runner:
            results = runner.score_sync([RewardInput("q", f"resp-{i}") for i in range(6)])
        assert [r.error for r in results] == [None] * 6 and [r.reward for r in results] == [0.7] * 6
        # in turn a, dead (passed on to b), b: a answers 2 calls, b 4 — none lost to the dead server
        assert (len(a.requests()), len(b.requests())) == (2, 4)
        with RewardRunner(judge_reward_fn("llm_judge", url=[dead, _dead_url()]), max_concurrency=1) as runner:
            (r,) = runner.score_sync([RewardInput("q", "resp")])
        assert (
            r.error is not None and r.error.startswith("JudgeError: judge http://127.0.0.1:") and "Connect" in r.error
        )
    finally:
        a.close()
        b.close()


def _cfg(tmp_path, judges: list[JudgeConfig], options: dict) -> RLConfig:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "label": "a"}}\n' for i in range(8)))
    cfg = load_config(RLConfig, None, [f"run_dir={tmp_path}/run"])
    cfg.data.domains = [
        DomainConfig(name="chat", path=str(data), rewards=[RewardHeadConfig(name="llm_judge", options=options)])
    ]
    cfg.judges = judges
    return cfg


def _errors(cfg: RLConfig) -> str:
    try:
        validate_rl_config(cfg, 1)
    except ConfigError as err:
        return str(err)
    return ""


def test_judge_groups_are_checked_before_workers_start(tmp_path) -> None:
    ok = JudgeConfig(name="grader", urls=["http://127.0.0.1:1"])
    assert _errors(_cfg(tmp_path, [ok], {"judge": "grader", "max_tokens": 8})) == ""
    msg = _errors(_cfg(tmp_path, [ok], {"judge": "grade"}))
    assert (
        "data.domains[0].rewards[0].options.judge: domain 'chat': 'grade' is not the name of a judge group (judges: grader)"
        in msg
    ), msg
    msg = _errors(_cfg(tmp_path, [ok], {"judge": "grader", "url": "http://127.0.0.1:2"}))
    assert (
        "data.domains[0].rewards[0].options.url: domain 'chat': give the judge's `url` or a `judge` group, not both"
        in msg
    ), msg
    msg = _errors(_cfg(tmp_path, [ok], {"judge": "grader", "temprature": 0.1}))
    assert "data.domains[0].rewards[0].options" in msg and "temprature" in msg, msg
    both = JudgeConfig(name="grader", urls=["http://127.0.0.1:1"], model_path=str(tmp_path))
    msg = _errors(_cfg(tmp_path, [ok, both, JudgeConfig(urls=["ftp://x"])], {"judge": "grader"}))
    for line in (
        "judges[1].name: 'grader' is also the name of judges[0]",
        "judges[1].urls: a judge group needs either urls (running servers) or model_path (engines the trainer starts), got both",
        f"judges[1].model_path: {str(tmp_path)!r} is not an HF checkpoint directory (no config.json)",
        "judges[2].name: a judge group needs a name",
        "judges[2].urls[0]: must be an http(s) URL, got 'ftp://x'",
    ):
        assert line in msg, msg


def test_a_started_judge_group_serves_the_rewards_and_stops_with_the_run(tmp_path) -> None:
    from mcore_rl.rollout.judges import JudgeEngines
    from mcore_rl.runtime.rollout_manager import build_reward_runner

    hf = save_tiny_hf_model(str(tmp_path / "judge_hf"), 512)
    cfg = _cfg(
        tmp_path, [JudgeConfig(name="grader", model_path=hf, engine_threads=1)], {"judge": "grader", "max_tokens": 4}
    )
    validate_rl_config(cfg, 1)
    judges = JudgeEngines(cfg.judges, workdir=str(tmp_path / "engines"), context_length=512, startup_timeout_s=120)
    pids = list(judges._processes[0].pids)
    try:
        rewards = build_reward_runner(cfg, judges.urls)
        try:
            (head,) = rewards.specs["chat"].rewards
            assert head.options == {"url": judges.urls["grader"], "max_tokens": 4}
            (runner,) = rewards.runners.values()
            (r,) = runner.score_sync([RewardInput("q", "an answer")])
        finally:
            rewards.close()
        # the tiny random judge answers garbage: its reply reached the trainer and, without a verdict,
        # scored the scale's lowest (counted), not an error that would leave the sample out of the loss
        assert (r.reward, r.error, r.info["judge_unparsed"]) == (0.0, None, 1), r
    finally:
        judges.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"


def test_a_group_not_among_the_run_judges_is_an_error() -> None:
    from mcore_rl.data.domains import DomainSpec, RewardHead
    from mcore_rl.runtime.rollout_manager import with_judge_urls

    specs = {"d": DomainSpec("d", [RewardHead("llm_judge", 1.0, {"judge": "x"})], 2, 1.0, -1, 8)}
    with pytest.raises(ValueError, match="judge group 'x' is not among the run's judges"):
        with_judge_urls(specs, {})
