"""Z-Reward's generative teacher (`rewards/generative_rm.py`) against real components: a tiny random
causal LM served by the project's own engines (a judge group the trainer starts, `mcore-rl serve`),
its score distribution against a hand computation with `transformers` on the same weights; the
reward head through the real reward pipeline (validation, judge group, runner), batched, a stopped
server costing its batch and a too-long row its own sample; the labeller's rows train the student
with `mcore-rl rm-train` (its KL to the teacher falls); bad options and bad rows refused by name."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from mcore_rl.config import RLConfig, load_config
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rl_schema import DomainConfig, JudgeConfig, RewardHeadConfig
from mcore_rl.config.rl_validate import validate_rl_config
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner
from mcore_rl.rewards.generative_rm import (
    GenerativeRMError,
    JudgeSpec,
    check_score_tokens,
    generative_rm_score,
    judge_for,
)
from tests.helpers import save_tiny_hf_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCORE_IDS = list(range(48, 58))  # "0".."9" in the byte tokenizer


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """The tiny random judge, served by one `mcore-rl serve` of a judge group (context 512)."""
    from mcore_rl.rollout.judges import JudgeEngines

    tmp = tmp_path_factory.mktemp("judge")
    hf = save_tiny_hf_model(str(tmp / "judge_hf"), 512)
    group = JudgeConfig(name="grader", model_path=hf, engine_threads=1)
    engines = JudgeEngines([group], workdir=str(tmp / "engines"), context_length=512, startup_timeout_s=120)
    yield hf, engines
    engines.close()


def _hand_q(model_dir: str, text: str, score_ids: list[int] = SCORE_IDS) -> torch.Tensor:
    """softmax over the score tokens of the next-token logits after `text`, with transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=True).eval()
    ids = load_tokenizer(None).encode(text)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(torch.log_softmax(logits, -1)[score_ids], -1)


def _runner(url, **options) -> RewardRunner:
    fn = RewardFunction(
        generative_rm_score, timeout_s=options.get("timeout", 25.0) + 5, options={"url": url, **options}
    )
    return RewardRunner(fn, max_concurrency=16)


def test_the_distribution_is_the_judges_next_token_probabilities_of_the_score_tokens(judge) -> None:
    hf, engines = judge
    url = engines.urls["grader"]
    samples = [RewardInput("12+30=", "42"), RewardInput("7+8=", "16"), RewardInput("1+1=", "2 - I checked it twice.")]
    with _runner(url) as runner:
        results = runner.score_sync(samples)
    spec = JudgeSpec()
    values = torch.arange(10, dtype=torch.float64)
    for s, r in zip(samples, results):
        assert r.error is None, r.error
        q = torch.tensor(r.info["score_distribution"], dtype=torch.float64)
        hand = _hand_q(hf, spec.render(s.prompt, s.completion))
        torch.testing.assert_close(q, hand, atol=2e-5, rtol=0)
        assert abs(q.sum().item() - 1) < 1e-9
        assert r.reward == pytest.approx(float((hand * values).sum()), abs=2e-4)
    # the three samples were one request (one batch of the judge's batcher)
    judge_ = judge_for(url, JudgeSpec(), 64, 25.0, None)  # the head's judge, made by the calls above
    assert judge_.batcher.batches == 1 and judge_.score_ids == SCORE_IDS


def test_score_values_and_tokens_are_the_papers_bins(judge) -> None:
    """Nine tokens "1".."9" worth 1.0, 1.5, ..., 5.0 (the paper's bins): μ = Σ v_s q(s) over them."""
    hf, engines = judge
    bins = [1.0 + 0.5 * k for k in range(9)]
    tokens = [str(k) for k in range(1, 10)]
    s = RewardInput("3+4=", "7")
    with _runner(engines.urls["grader"], score_tokens=tokens, score_values=bins, rubric="Is the sum right?") as runner:
        (r,) = runner.score_sync([s])
    hand = _hand_q(hf, JudgeSpec(rubric="Is the sum right?").render(s.prompt, s.completion), SCORE_IDS[1:])
    assert r.reward == pytest.approx(float((hand * torch.tensor(bins, dtype=torch.float64)).sum()), abs=2e-4)


def test_failures_cost_their_samples_not_the_run(judge) -> None:
    """A response too long for the judge's context is refused by the server (400): that row alone
    scores the lowest value, `refused` in its info, its batch-mates are scored; a stopped server
    costs the batch at the timeout (reward errors), and the next batch scores once it runs again."""
    _, engines = judge
    url = engines.urls["grader"]
    samples = [RewardInput("1+1=", "2"), RewardInput("1+1=", "9" * 600), RewardInput("2+2=", "4")]
    with _runner(url, timeout=20.0) as runner:
        ok1, refused, ok2 = runner.score_sync(samples)
    assert ok1.error is None and ok2.error is None and 0 < ok1.reward < 9
    assert refused.error is None and refused.reward == 0.0 and "HTTP 400" in refused.info["refused"], refused
    pid = engines._processes[0].pids[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        with _runner(url, timeout=2.0) as runner:
            results = runner.score_sync(samples[:1] + samples[2:])
        assert all(r.error is not None and "no reply within 2s" in r.error for r in results), [r.error for r in results]
    finally:
        os.kill(pid, signal.SIGCONT)
    with _runner(url, timeout=20.0) as runner:
        again = runner.score_sync(samples[:1])
    assert again[0].error is None and again[0].reward == pytest.approx(ok1.reward, abs=1e-6)


def _cfg(tmp_path, judges: list[JudgeConfig], options: dict) -> RLConfig:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(8)))
    cfg = load_config(RLConfig, None, [f"run_dir={tmp_path}/run"])
    cfg.data.domains = [
        DomainConfig(name="sums", path=str(data), rewards=[RewardHeadConfig(name="generative_rm", options=options)])
    ]
    cfg.judges = judges
    return cfg


def _errors(cfg: RLConfig) -> str:
    try:
        validate_rl_config(cfg, 1)
    except ConfigError as err:
        return str(err)
    return ""


def test_options_are_checked_before_workers_start(tmp_path) -> None:
    group = [JudgeConfig(name="grader", urls=["http://127.0.0.1:1"])]
    assert _errors(_cfg(tmp_path, group, {"judge": "grader"})) == ""
    key = "data.domains[0].rewards[0].options"
    for options, line in [
        ({}, f"{key}.url: domain 'sums': the judge server's http(s) address"),
        ({"judge": "grader", "score_tokens": ["1"]}, f"{key}.score_tokens: domain 'sums': a list of at least 2"),
        ({"judge": "grader", "score_tokens": ["1", "1"]}, f"{key}.score_tokens: domain 'sums': each score token"),
        ({"judge": "grader", "score_values": [1, 2]}, f"{key}.score_values: domain 'sums': 10 finite numbers"),
        ({"judge": "grader", "template": "{prompt} only"}, f"{key}.template: domain 'sums': must hold {{prompt}}"),
        ({"judge": "grader", "template": "{prompt}{response}{x}"}, f"{key}.template: domain 'sums': unknown fields"),
        ({"judge": "grader", "chat_format": "x"}, f"{key}.chat_format: domain 'sums': 'x' is not one of"),
        ({"judge": "grader", "timeout": 0}, f"{key}.timeout: domain 'sums': must be > 0"),
        ({"judge": "grader", "refused_score": "low"}, f"{key}.refused_score: domain 'sums': must be a finite"),
        ({"judge": "grader", "temperature": 1}, f"{key}.temperature: domain 'sums': not an option of 'generative_rm'"),
        ({"judge": "grader", "reasoning_tokens": -1}, f"{key}.reasoning_tokens: domain 'sums': an integer >= 0"),
    ]:
        msg = _errors(_cfg(tmp_path, group, options))
        assert line in msg, (options, msg)


def test_a_score_of_several_tokens_is_refused_naming_the_key(judge, tmp_path) -> None:
    """ "10" is two tokens of the byte tokenizer: the judge's /tokenize says so before training
    (the run's check, naming the head's key), and a sample scored anyway is an error saying why."""
    from mcore_rl.runtime.loop import check_generative_judges

    _, engines = judge
    url = engines.urls["grader"]
    assert check_score_tokens(url, [str(d) for d in range(10)]) == SCORE_IDS
    with pytest.raises(GenerativeRMError, match=r"^score_tokens: '10' is 2 tokens \[49, 48\] of the judge's tokenizer"):
        check_score_tokens(url, ["0", "5", "10"])
    cfg = _cfg(tmp_path, [JudgeConfig(name="grader", urls=url)], {"judge": "grader", "score_tokens": ["0", "5", "10"]})
    assert _errors(cfg) == ""  # nothing wrong without the judge's tokenizer
    with pytest.raises(ValueError, match=r"^data\.domains\[0\]\.rewards\[0\]\.options\.score_tokens: '10' is 2 tokens"):
        check_generative_judges(cfg, engines.urls, groups_only=True)
    cfg = _cfg(tmp_path, [], {"url": url[0], "score_tokens": ["0", "5", "10"]})  # a server by its url: at run start
    assert _errors(cfg) == ""
    with pytest.raises(ValueError, match=r"^data\.domains\[0\]\.rewards\[0\]\.options\.score_tokens: '10' is 2 tokens"):
        check_generative_judges(cfg, {})
    cfg.data.domains[0].rewards[0].options["score_tokens"] = ["0", "5", "9"]
    check_generative_judges(cfg, {})
    with _runner(url, score_tokens=["0", "5", "10"]) as runner:
        (r,) = runner.score_sync([RewardInput("1+1=", "2")])
    assert r.error is not None and "score_tokens: '10' is 2 tokens" in r.error


def test_the_head_in_the_real_reward_pipeline_of_a_run(judge, tmp_path) -> None:
    """validate -> the run's reward runner with the judge group's servers -> one group scored as
    one batch; the rewards are the expected scores of the hand computation."""
    from mcore_rl.runtime.loop import check_generative_judges
    from mcore_rl.runtime.rollout_manager import build_reward_runner

    hf, engines = judge
    cfg = _cfg(tmp_path, [JudgeConfig(name="grader", urls=engines.urls["grader"])], {"judge": "grader", "max_batch": 4})
    validate_rl_config(cfg, 1)
    check_generative_judges(cfg, engines.urls, groups_only=True)
    rewards = build_reward_runner(cfg, engines.urls)
    try:
        (runner,) = rewards.runners.values()
        samples = [RewardInput("5+1=", str(k)) for k in range(4, 10)]
        results = runner.score_sync(samples)
    finally:
        rewards.close()
    spec = JudgeSpec()
    for s, r in zip(samples, results):
        hand = _hand_q(hf, spec.render(s.prompt, s.completion))
        assert r.error is None and r.reward == pytest.approx(float((hand * torch.arange(10.0)).sum()), abs=2e-4)
    judge_ = judge_for(engines.urls["grader"], JudgeSpec(), 4, 25.0, None)
    assert judge_.batcher.batches == 2  # six samples, max_batch 4


def _tool(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "tools" / "label_score_distributions.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_labellers_rows_train_the_student(judge, tmp_path) -> None:
    """Pairs from a shipped task -> the teacher's q per response (the head's numbers) -> `rm-train`
    with `score_distribution`: the student's KL to the teacher falls."""
    hf, engines = judge
    url = engines.urls["grader"][0]
    pairs = tmp_path / "pairs.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_preference_pairs.py"), "--num", "48", "--out", str(pairs)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=True,
        capture_output=True,
    )
    out = tmp_path / "teacher.jsonl"
    run = _tool("--url", url, "--data", str(pairs), "--out", str(out), "--batch", "32")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 96 and all(len(r["label"]) == 10 for r in rows)
    first = json.loads(pairs.read_text().splitlines()[0])
    assert (rows[0]["response"], rows[1]["response"]) == (first["chosen"], first["rejected"])
    hand = _hand_q(hf, JudgeSpec().render(rows[0]["prompt"], rows[0]["response"]))
    torch.testing.assert_close(torch.tensor(rows[0]["label"], dtype=torch.float64), hand, atol=2e-5, rtol=0)
    assert rows[0]["expected_score"] == pytest.approx(float((hand * torch.arange(10.0)).sum()), abs=2e-4)

    run_dir = tmp_path / "student"
    train = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "rm-train", str(ROOT / "configs" / "rm_demo.yaml")]
        + [f"run_dir={run_dir}", f"data.path={out}"]
        + ["reward_model.objective=score_distribution", "reward_model.num_heads=10", "train.seq_length=24"]
        + [
            "train.train_iters=12",
            "train.log_interval=1",
            "train.eval_interval=100",
            "train.eval_iters=1",
            "optimizer.lr=3e-3",
        ]
        + ["train.micro_batch_size=8", "train.global_batch_size=8", f"checkpoint.save_dir={run_dir}/ckpt"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses


def test_the_labeller_refuses_bad_rows_and_multi_token_scores(judge, tmp_path) -> None:
    _, engines = judge
    url = engines.urls["grader"][0]
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+1=", "response": "2"})
        + "\n"
        + json.dumps({"prompt": "1+1="})
        + "\n"
        + json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": " "})
        + "\n"
    )
    run = _tool("--url", url, "--data", str(data), "--out", str(tmp_path / "o.jsonl"))
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode != 0 and last.startswith(f"{data}:2: missing key(s)") and "--on-bad-line skip" in last
    run = _tool("--url", url, "--data", str(data), "--out", str(tmp_path / "o.jsonl"), "--on-bad-line", "skip")
    assert run.returncode == 0, run.stderr[-2000:]
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 1
    run = _tool(
        "--url",
        url,
        "--data",
        str(data),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--score-tokens",
        "0,5,10",
        "--on-bad-line",
        "skip",
    )
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith(
        "--score-tokens: '10' is 2 tokens [49, 48] of the judge's tokenizer"
    ), run.stderr[-1000:]
    run = _tool("--url", url, "--data", str(data), "--out", str(tmp_path / "o.jsonl"), "--score-values", "1,2")
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith("--score-values: 10 finite numbers")


def _rl_step(rank: int, world_size: int, tmp: str, hf: str) -> None:
    from mcore_rl.runtime import run_rl
    from tests.helpers import tiny

    cfg = tiny(f"run_dir={tmp}/run", "train.num_steps=1", "eval.interval=0", "rollout.quantization=none")
    head = RewardHeadConfig(name="generative_rm", options={"judge": "teacher", "rubric": "Is the sum right?"})
    cfg.data.domains = [DomainConfig(name="add", task="addition", options={"max_digits": 1}, rewards=[head])]
    cfg.judges = [JudgeConfig(name="teacher", model_path=hf, engine_threads=1, context_length=512)]
    validate_rl_config(cfg, 1)
    run_rl(cfg)


def test_one_rl_step_with_the_teacher_as_the_domains_reward(tmp_path) -> None:
    """One real RL step of the tiny policy whose only reward head is the generative teacher, served
    by a judge group the trainer starts: every sample scored (no reward errors), the rewards
    expected scores strictly inside [0, 9] and not all equal."""
    from tests.world import run_world

    hf = save_tiny_hf_model(str(tmp_path / "judge_hf"), 512)
    run_world(1, _rl_step, str(tmp_path), hf)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/add/head/generative_rm" in r and "reward/error_frac" in r]
    assert steps, records
    step = steps[0]
    assert step["reward/error_frac"] == 0.0, step
    assert 0 < step["reward/mean"] < 9 and step["reward/std"] > 0, step


def test_a_teacher_that_reasons_first_is_scored_after_its_reasoning(judge) -> None:
    """`reasoning_tokens`: the judge's greedy reply to the prompt without the cue (stopped at the
    cue), then the cue: q is the hand computation's on exactly that text."""
    import requests

    hf, engines = judge
    url = engines.urls["grader"][0]
    s = RewardInput("12+30=", "42")
    spec = JudgeSpec()
    head = spec.render(s.prompt, s.completion)[: -len(spec.cue)]
    body = {"text": head, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "stop": [spec.cue.strip()]}}
    reasoning = requests.post(f"{url}/generate", json=body, timeout=60).json()["text"]
    assert reasoning  # the random model wrote something before its score
    with _runner(engines.urls["grader"], reasoning_tokens=6) as runner:
        (r,) = runner.score_sync([s])
    hand = _hand_q(hf, head + reasoning + spec.cue)
    torch.testing.assert_close(torch.tensor(r.info["score_distribution"], dtype=torch.float64), hand, atol=2e-5, rtol=0)
    assert _hand_q(hf, spec.render(s.prompt, s.completion)).sub(hand).abs().max() > 1e-4  # not the direct q
