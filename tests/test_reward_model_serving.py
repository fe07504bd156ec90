"""A trained reward model as a reward head: batched on the runner's event loop, one sample's failure
costs that sample, refused when its tokenizer is not the policy's; served by a real `mcore-rl serve
--is-embedding` process on SGLang's `/classify`, its scores the in-process head's, a stopped or killed
server costing the samples of its batch only (one server for the module)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
import torch

from mcore_rl.parallel.lifetime import preexec_die_with_parent

from mcore_rl.rewards.base import RewardFunction, RewardInput, RewardRunner
from mcore_rl.rewards.registry import get_reward_fn
from mcore_rl.rewards.reward_model import load_batcher, reward_model_score

EOS, PAD, VOCAB = 5, 0, 384  # the bundled byte tokenizer's size: the server loads that tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    config.num_labels = 2
    path = str(tmp_path_factory.mktemp("rm") / "hf")
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    return path


def _sample(prompt: list[int], response: list[int]) -> RewardInput:
    return RewardInput("p", "c", metadata={"prompt_ids": prompt, "response_ids": response})


def _alone(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = load_batcher(model_dir).forward.model
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_a_group_is_one_batch_and_scores_as_alone(model_dir):
    assert get_reward_fn("reward_model") is reward_model_score
    group = [_sample([1, 7, 8], [9, 10, EOS]), _sample([1, 7], [11, EOS]), _sample([1, 7, 8, 12], [13])]
    runner = RewardRunner(RewardFunction(reward_model_score, options={"model_dir": model_dir, "head": 1}))
    assert runner.isolation == "async"
    batcher = load_batcher(model_dir)
    before = batcher.batches
    results = runner.score_sync(group, [0, 0, 0])
    assert batcher.batches == before + 1  # the group's three calls: one padded forward
    assert all(r.error is None for r in results), [r.error for r in results]
    # each as scored alone; the length-cut response (no eos) is scored with its eos appended
    expected = [_alone(model_dir, ids)[1] for ids in ([1, 7, 8, 9, 10, EOS], [1, 7, 11, EOS], [1, 7, 8, 12, 13, EOS])]
    for r, want in zip(results, expected):
        assert abs(r.reward - float(want)) < 1e-5


def test_a_bad_sample_costs_only_itself(model_dir):
    group = [
        _sample([1, 7], [8, EOS]),
        _sample([1, 7], [VOCAB + 3, EOS]),  # another tokenizer's id
        RewardInput("p", "c"),  # no token ids
        _sample([1, 9], [8, EOS]),
    ]
    runner = RewardRunner(RewardFunction(reward_model_score, options={"model_dir": model_dir, "refused_score": -7.5}))
    results = runner.score_sync(group, [0, 0, 0, 0])
    assert results[0].error is None and results[3].error is None
    # the id the model cannot read is the sample's own doing: the worst outcome, not a reward error
    assert results[1].error is None and results[1].reward == -7.5
    assert f"outside the reward model's vocabulary of {VOCAB}" in results[1].info["refused"]
    assert "carries no token ids" in results[2].error  # no ids at all: the caller's fault, an error


def test_without_refused_score_a_refused_sample_scores_the_lowest_bin_or_the_lowest_seen(model_dir):
    bad = _sample([1], [VOCAB + 1, EOS])
    fresh = {"model_dir": model_dir, "max_batch": 5}  # a batcher of its own: nothing scored yet
    with pytest.raises(ValueError, match="no refused_score is set, nor any score seen yet"):
        asyncio.run(reward_model_score(bad, **fresh))  # nothing says what "worst" is: a reward error
    bins = asyncio.run(reward_model_score(bad, **fresh, score_bins=[1.0, 5.0]))
    assert bins["reward"] == 1.0  # a score distribution's lowest bin
    group = [_sample([1, 7], [8, EOS]), _sample([1, 9], [10, 11, EOS]), _sample([2], [3, EOS])]
    runner = RewardRunner(RewardFunction(reward_model_score, options={**fresh, "head": 1}))
    scores = [r.reward for r in runner.score_sync(group, [0, 0, 0])]
    worst = runner.score_sync([bad], [0])[0]
    assert worst.error is None and worst.reward == pytest.approx(min(scores), abs=1e-6)


def test_a_score_distribution_model_gives_its_expected_score(model_dir):
    """Z-Reward's student: the reward is Σ_s s·softmax(logits)_s over the configured bins."""
    sample = _sample([1, 7], [8, EOS])
    got = asyncio.run(reward_model_score(sample, model_dir=model_dir, score_bins=[1.0, 5.0]))
    q = torch.softmax(_alone(model_dir, [1, 7, 8, EOS]).double(), -1)
    assert got == pytest.approx(float(q[0] * 1.0 + q[1] * 5.0), abs=1e-6)
    with pytest.raises(ValueError, match="score_bins has 3 bins, the reward model .* 2 labels"):
        asyncio.run(reward_model_score(sample, model_dir=model_dir, score_bins=[1.0, 3.0, 5.0]))


def test_a_directory_with_another_tokenizer_of_the_same_size_is_refused_before_workers_start(model_dir, tmp_path):
    """A vocabulary of the policy's size says nothing about which text an id stands for: a reward
    model directory that holds a tokenizer is compared with the policy's by probes (texts to ids, ids
    to text) at validation, naming the key and the first difference; the policy's own tokenizer passes."""
    import shutil

    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rl_schema import DomainConfig, RewardHeadConfig
    from mcore_rl.config.rl_validate import validate_rl_config
    from mcore_rl.data.tokenizer import NAMED_SPECIAL_TOKENS, ByteTokenizer

    def config(path: str) -> RLConfig:
        cfg = load_config(RLConfig, None, [f"model.vocab_size={VOCAB}"])
        head = RewardHeadConfig(name="reward_model", options={"model_dir": path})
        cfg.data.domains = [DomainConfig(name="add", task="addition", rewards=[head])]
        return cfg

    same, other = str(tmp_path / "same"), str(tmp_path / "other")
    shutil.copytree(model_dir, same)
    shutil.copytree(model_dir, other)
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB - 256 - len(NAMED_SPECIAL_TOKENS))]
    ByteTokenizer.default().save(same)
    swapped = ["<pad>", "<bos>", "<|im_start|>", "<eos>", "<|im_end|>"]  # <eos> at another id, same size
    ByteTokenizer(swapped + reserved, VOCAB).save(other)
    validate_rl_config(config(same), 1)  # the policy's tokenizer: accepted
    with pytest.raises(
        ConfigError,
        match=r"data.domains\[0\].rewards\[0\].options.model_dir: domain 'add': the reward model's tokenizer "
        r".* is not the policy's \(data.tokenizer_path = None\): '<eos>' encodes to \[259\], the policy's "
        r"tokenizer gives \[258\]",
    ):
        validate_rl_config(config(other), 1)


def test_another_tokenizer_is_refused(model_dir):
    with pytest.raises(ValueError, match=f"ends sequences with token {EOS}, the policy with 2"):
        asyncio.run(reward_model_score(_sample([1], [2]), model_dir=model_dir, eos_token_id=2))
    with pytest.raises(ValueError, match="head 2 is not one of the model's 2 scores"):
        asyncio.run(reward_model_score(_sample([1], [2]), model_dir=model_dir, head=2))


def test_a_domain_head_scores_the_policy_tokens(model_dir):
    """The rollout's reward path hands the policy's token ids to the head, with the domain's other heads."""
    from mcore_rl.data.domains import DomainSpec, RewardHead
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.runtime.rollout_manager import DomainRewards

    head = RewardHead("reward_model", 2.0, {"model_dir": model_dir, "eos_token_id": EOS})
    specs = {"sums": DomainSpec("sums", [head], group_size=2, top_p=1.0, top_k=-1, max_new_tokens=4)}
    rewards = DomainRewards(specs, timeout_s=60, error_reward=0.0, max_concurrency=2)
    prompt = Prompt(0, "1+1=", [1, 7, 8], domain="sums")
    samples = [Sample(prompt, 0, [9, EOS], [0.0, 0.0], 0, "stop"), Sample(prompt, 0, [10], [0.0], 0, "length")]
    try:
        rewards.score_sync(samples)
    finally:
        rewards.close()
    for s, ids in zip(samples, ([1, 7, 8, 9, EOS], [1, 7, 8, 10, EOS])):
        assert s.reward_error is None, s.reward_error
        assert abs(s.reward_heads["reward_model"] - float(_alone(model_dir, ids)[0])) < 1e-5
        assert s.reward == 2.0 * s.reward_heads["reward_model"]


def test_a_reward_model_that_cannot_read_every_policy_id_is_refused_before_workers_start(model_dir, tmp_path):
    """An id past the reward model's vocabulary makes its sample a reward error (left out of the loss),
    so a policy with a larger vocabulary could escape a low score: refused at validation, naming the key."""
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rl_schema import DomainConfig, RewardHeadConfig
    from mcore_rl.config.rl_validate import validate_rl_config

    def config(vocab: int, path: str) -> RLConfig:
        cfg = load_config(RLConfig, None, [f"model.vocab_size={vocab}"])
        head = RewardHeadConfig(name="reward_model", options={"model_dir": path})
        cfg.data.domains = [DomainConfig(name="add", task="addition", rewards=[head])]
        return cfg

    validate_rl_config(config(VOCAB, model_dir), 1)  # the same vocabulary: accepted
    with pytest.raises(
        ConfigError, match=r"data.domains\[0\].rewards\[0\].options.model_dir: domain 'add': the reward "
    ):
        validate_rl_config(config(VOCAB + 1, model_dir), 1)
    with pytest.raises(ConfigError, match=r"options.model_dir: domain 'add': .*config.json cannot be read"):
        validate_rl_config(config(VOCAB, str(tmp_path / "nowhere")), 1)
    bad = config(VOCAB, model_dir)
    bad.data.domains[0].rewards[0].options["refused_score"] = "low"
    with pytest.raises(ConfigError, match=r"rewards\[0\].options.refused_score: domain 'add': must be a finite number"):
        validate_rl_config(bad, 1)
    prm = config(VOCAB, model_dir)
    prm.data.domains[0].rewards = [RewardHeadConfig(name="prm", weight=0.0, options={"url": "http://127.0.0.1:1"})]
    with pytest.raises(
        ConfigError, match=r"rewards\[0\].options.step_delimiter_ids: domain 'add': must be a non-empty"
    ):
        validate_rl_config(prm, 1)
    prm.data.domains[0].rewards[0].options["step_delimiter_ids"] = [9]
    validate_rl_config(prm, 1)  # a served PRM: accepted (its tokenizer is probed when the run starts)
    both = config(VOCAB, model_dir)
    both.data.domains[0].rewards[0].options["url"] = "http://127.0.0.1:1"
    with pytest.raises(
        ConfigError, match=r"rewards\[0\].options: domain 'add': give the reward model's `model_dir` or"
    ):
        validate_rl_config(both, 1)


# ---- served by `mcore-rl serve --is-embedding` (SGLang's /classify) ---------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(model_dir):
    """(url, process) of a real `mcore-rl serve --is-embedding` process serving the tiny RM."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.cli", "serve", "--model-path", model_dir, "--is-embedding"]
        + ["--port", str(port), "--device", "cpu"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=preexec_die_with_parent(signal.SIGKILL),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"mcore-rl serve --is-embedding did not come up (exit {proc.poll()})") from None
                time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        proc.wait(30)


def _post(url: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_served_classify_speaks_sglangs_reward_model_api(served, model_dir):
    url, _ = served
    status, info = _post(url + "/classify", {"input_ids": [1, 7, 8, EOS]})  # one row: one object
    assert status == 200 and set(info) == {"embedding", "meta_info"}, info
    assert torch.allclose(torch.tensor(info["embedding"]), _alone(model_dir, [1, 7, 8, EOS]), atol=1e-5)
    assert info["meta_info"]["prompt_tokens"] == 4
    status, rows = _post(url + "/classify", {"input_ids": [[1, 7], [1, 7, 8, 9, EOS]], "rid": ["a", "b"]})
    assert status == 200 and [r["meta_info"]["id"] for r in rows] == ["a", "b"]
    status, err = _post(url + "/classify", {"input_ids": [[1, VOCAB]]})
    assert (
        status == 400
        and f"input_ids[0]: token id {VOCAB} is outside the vocabulary of {VOCAB}" in err["error"]["message"]
    )
    status, err = _post(url + "/classify", {"input_ids": [[1]], "image_data": "x.png"})
    assert status == 400 and "image_data" in err["error"]["message"]
    with urllib.request.urlopen(url + "/model_info", timeout=10) as resp:
        assert json.loads(resp.read())["is_generation"] is False
    assert _post(url + "/generate", {"input_ids": [1]})[0] == 404  # a reward model does not generate


def test_a_served_reward_model_scores_as_the_head_in_process(served, model_dir):
    url, _ = served
    group = [_sample([1, 7, 8], [9, 10, EOS]), _sample([1, 7], [11, EOS]), _sample([1, 7, 8, 12], [13])]
    options = {"url": url, "head": 1, "eos_token_id": EOS}
    runner = RewardRunner(RewardFunction(reward_model_score, options=options))
    before = {k: b.batches for k, b in list(_batchers().items())}
    results = runner.score_sync(group, [0, 0, 0])
    assert all(r.error is None for r in results), [r.error for r in results]
    (key,) = [k for k in _batchers() if k[0] == "url"]
    assert _batchers()[key].batches == before.get(key, 0) + 1  # the group: one /classify request
    local = RewardRunner(RewardFunction(reward_model_score, options={"model_dir": model_dir, "head": 1}))
    for r, want in zip(results, local.score_sync(group, [0, 0, 0])):
        assert abs(r.reward - want.reward) < 1e-5
    # a row the server refuses (an id outside its vocabulary) scores the worst outcome; the batch is
    # rescored row by row, so the others keep their scores
    runner = RewardRunner(RewardFunction(reward_model_score, options={**options, "refused_score": -3.0}))
    bad = [_sample([1, 7], [8, EOS]), _sample([1, 7], [VOCAB + 3, EOS]), RewardInput("p", "c"), _sample([1], [9])]
    results = runner.score_sync(bad, [0, 0, 0, 0])
    assert results[0].error is None and results[3].error is None, [r.error for r in results]
    assert results[1].error is None and results[1].reward == -3.0
    assert f"token id {VOCAB + 3} is outside the vocabulary of {VOCAB}" in results[1].info["refused"]
    assert "carries no token ids" in results[2].error


def test_a_served_prm_gives_the_step_beliefs_of_the_prm_in_process(served, model_dir):
    """`/classify` reads a row at its last token; each step's prefix as its own row gives the same μ, σ
    per step as the per-token forward in the trainer's process."""
    from mcore_rl.rewards.process_reward import prm_score

    delimiter = [9]
    samples = [_sample([1, 7], [8, 9, 10, 11, 9, 12, EOS]), _sample([1], [13, 9]), _sample([2, 3], [14])]
    for s in samples:
        local = asyncio.run(prm_score(s, model_dir=model_dir, step_delimiter_ids=delimiter, eos_token_id=EOS))
        remote = asyncio.run(prm_score(s, url=served[0], step_delimiter_ids=delimiter, eos_token_id=EOS))
        assert len(remote["step_mean"]) == len(local["step_mean"]) >= 1
        assert remote["reward"] == pytest.approx(local["reward"], abs=1e-5)
        assert remote["step_mean"] == pytest.approx(local["step_mean"], abs=1e-5)
        assert remote["step_std"] == pytest.approx(local["step_std"], abs=1e-5)
    refused = asyncio.run(prm_score(_sample([1], [VOCAB + 2, 9]), url=served[0], step_delimiter_ids=delimiter))
    assert refused["reward"] == 0.0 and "outside the vocabulary" in refused["refused"]  # μ's worst
    empty = asyncio.run(prm_score(_sample([1], [EOS]), url=served[0], step_delimiter_ids=delimiter, eos_token_id=EOS))
    assert empty["reward"] == 0.0 and "no step" in empty["refused"]


def test_a_served_reward_model_with_another_tokenizer_is_refused_before_training(served):
    """As engine teachers are: the served model must tokenize like the policy (SGLang's /tokenize,
    /detokenize) and read its last id (/classify); else the error names the config key and the server."""
    from mcore_rl.data.tokenizer import ByteTokenizer, load_tokenizer
    from mcore_rl.rollout.classifier import RewardServerError, check_served_reward_model

    url, _ = served
    policy = load_tokenizer(None)
    check_served_reward_model(url, policy, "data.domains[0].rewards[0].options.url")  # the same: accepted
    other = list(policy.special_tokens)
    other[0], other[2] = other[2], other[0]  # <pad> and <eos> swapped: another tokenizer of the same size
    with pytest.raises(RewardServerError, match=r"data.domains\[0\].rewards\[0\].options.url: the reward model at "):
        check_served_reward_model(url, ByteTokenizer(other, VOCAB), "data.domains[0].rewards[0].options.url")
    with pytest.raises(RewardServerError, match="does not share the policy's tokenizer"):
        check_served_reward_model(url, ByteTokenizer(other, VOCAB), "k")
    with pytest.raises(RewardServerError, match="k: the reward model at http://127.0.0.1:1: "):
        check_served_reward_model("http://127.0.0.1:1", policy, "k")  # nothing listens


def _batchers() -> dict:
    from mcore_rl.rewards import reward_model

    return reward_model._BATCHERS


def test_a_stopped_or_killed_server_costs_the_samples_of_its_batch(served, model_dir):
    """Runs last in the module: it kills the module's server."""
    url, proc = served
    group = [_sample([1, 7], [8, EOS]), _sample([1, 9], [10, EOS])]

    def runner(timeout: float) -> RewardRunner:
        return RewardRunner(RewardFunction(reward_model_score, options={"url": url, "timeout": timeout}))

    os.kill(proc.pid, signal.SIGSTOP)  # hangs: the batch's samples time out, the run goes on
    try:
        results = runner(1.0).score_sync(group, [0, 0])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert all("no reply within 1s" in (r.error or "") for r in results), [r.error for r in results]
    results = runner(30.0).score_sync(group, [0, 0])  # back: the next batch scores
    assert all(r.error is None for r in results), [r.error for r in results]

    # killed while a batch is in flight (the request is sent to a stopped server, then it dies)
    os.kill(proc.pid, signal.SIGSTOP)
    out: list = []
    scorer = threading.Thread(target=lambda: out.extend(runner(60.0).score_sync(group, [0, 0])))
    start = time.monotonic()
    scorer.start()
    deadline = time.time() + 30
    port = int(url.rsplit(":", 1)[1])
    me = psutil.Process()
    while not any(
        c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in me.net_connections()
    ):
        assert time.time() < deadline, "the batch's request never reached the server"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    scorer.join(60)
    assert len(out) == 2 and all(r.error and "reward model" in r.error for r in out), [r.error for r in out]
    assert time.monotonic() - start < 30  # failed when the server died, not at the timeout
    # the next batch fails fast too (nothing listens), and a head in the trainer's process still scores
    assert all(r.error for r in runner(60.0).score_sync(group[:1], [0]))
    local = RewardRunner(RewardFunction(reward_model_score, options={"model_dir": model_dir}))
    assert all(r.error is None for r in local.score_sync(group, [0, 0]))
