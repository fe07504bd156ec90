"""The RL loop (`mcore-rl train`): config validation, batch building, and end-to-end runs on CPU.

The end-to-end runs use tiny sizes: a 2-layer 32-wide model, a few SFT steps, 3 rollout steps of
4 prompts x 4 samples from the embedded FP8 engine. What they check: metrics.jsonl has one record
per optimizer step with the required fields; samples carry the weight version that generated them
and the engine's log-probs; a run resumed from a checkpoint continues at the right step with the
numbers the uninterrupted run had; MIPU, KL to a reference, entropy, dynamic sampling and GSPO run;
the HTTP path (engine URL + weight sync over `/update_weights_from_tensor`) works; TP=2 runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.data.prompts import PromptSource, task_pool
from mcore_rl.data.samples import Prompt
from mcore_rl.train.packing import build_microbatches, sequence_view, split_minibatches
from tests.world import run_world
from tests.helpers import _records, _samples, tiny

# ------------------------------------------------------------------------------------ config


def test_demo_recipe_is_valid():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(RLConfig, os.path.join(here, "configs", "demo.yaml"))
    validate_rl_config(cfg, 1)
    assert (
        cfg.rollout.quantization == "fp8"
        and cfg.algorithm.mismatch.name == "tis"
        and cfg.init.sft.train.train_iters > 0
    )


def test_unknown_keys_fail_while_loading_unknown_names_in_validation():
    with pytest.raises(ConfigError, match="algorithm.mismatch.name: unknown mismatch correction 'bogus'"):
        validate_rl_config(tiny("algorithm.mismatch.name=bogus"), 2)
    with pytest.raises(ConfigError, match="did you mean 'rollout.group_size'"):
        tiny("rollout.groupsize=4")


def test_cli_train_fails_before_launch(capsys):
    from mcore_rl.cli import main

    assert main(["train", "rollout.max_staleness=3"]) == 2
    assert "rollout.max_staleness" in capsys.readouterr().err


def test_cli_train_with_an_unknown_reward_fails_in_seconds():
    """The reward module is imported by validation, not after the SFT warm start (demo: 500 steps)."""
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", "configs/demo.yaml", "reward.name=nosuchmod:fn"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stderr
    assert (
        "reward.name: 'nosuchmod:fn' cannot be loaded: ModuleNotFoundError: No module named 'nosuchmod'" in out.stderr
    )
    assert out.stdout == "" and elapsed < 30, (elapsed, out.stdout)


# ------------------------------------------------------------------------------------ batches


@pytest.mark.parametrize("dp", [1, 2])
def test_packed_microbatches_locate_every_response_token(dp):
    samples = _samples()
    view = sequence_view(samples)
    n, t = view.mask.shape
    per_seq = {"rollout_logp": view.rollout_logp, "advantages": torch.arange(n, dtype=torch.float32)}
    seen = []
    for rank in range(dp):
        mbs = build_microbatches(
            samples,
            list(range(n))[::-1],
            seq_length=16,
            micro_batch_size=2,
            dp_rank=rank,
            dp_size=dp,
            pad_id=0,
            num_positions=t,
            per_seq=per_seq,
        )
        counts = {len(build_microbatches(samples, range(n), 16, 2, r, dp, 0, t)) for r in range(dp)}
        assert len(counts) == 1  # every DP rank runs the same number of micro-batches
        for mb in mbs:
            assert mb["tokens"].shape == (2, 16)
            labels = mb["labels"].reshape(-1)
            for k, i in enumerate(mb["seq_index"].tolist()):
                rsp = samples[i].response_ids
                got = labels[mb["seq_pos"][k, : len(rsp)]].tolist()
                assert got == rsp  # the label at seq_pos is the response token
                assert mb["loss_mask"].reshape(-1)[mb["seq_pos"][k, : len(rsp)]].eq(1).all()
                assert torch.equal(mb["rollout_logp"][k], view.rollout_logp[i])
                assert mb["advantages"][k] == i
                seen.append(i)
            # segments keep samples apart: positions restart at every sample
            assert (mb["position_ids"][mb["segment_ids"] > 0] >= 0).all()
    assert sorted(seen) == list(range(n))  # each sample in exactly one micro-batch of one rank


def test_sequence_view_and_minibatches():
    samples = _samples()
    samples[1].reward_error = "ValueError: boom"
    samples[2].finish_reason = "abort"
    view = sequence_view(samples)
    assert view.versions.eq(7).all() and view.ok[:3].tolist() == [1.0, 0.0, 0.0]
    assert view.mask.sum(1).tolist() == [len(s.response_ids) for s in samples]
    parts = split_minibatches(len(samples), 4, seed=1, step=3, epoch=0)
    assert sorted(i for p in parts for i in p) == list(range(len(samples))) and len(parts) == 4
    assert parts == split_minibatches(len(samples), 4, seed=1, step=3, epoch=0)


def test_learner_leaves_failed_samples_out_of_the_group_statistics(monkeypatch):
    from mcore_rl.train.rl_step import Learner

    samples = _samples()  # 5 groups of 3, rewards [1, 0, 0] each
    samples[1].reward_error = "timeout after 2s"  # group 0: one right, one failed, one wrong
    samples[3].reward_error = samples[4].reward_error = "ValueError: boom"  # group 1: one valid sample left
    learner = Learner(tiny(), chunks=[], optimizer=None, ref_chunks=None, pad_id=0)
    # the one forward-only log-prob path (token_logprobs goes through it too)
    monkeypatch.setattr(
        learner,
        "token_stats",
        lambda s, t, chunks=None, with_entropy=False, **kw: (
            torch.tensor([[-0.1] * t] * len(s)),
            torch.zeros(len(s), t),
            None,
        ),
    )
    per_seq, metrics = learner.prepare(samples)
    adv = per_seq["advantages"]
    torch.testing.assert_close(adv[:3], torch.tensor([0.7071, 0.0, -0.7071]), atol=1e-4, rtol=0)
    assert adv[3:6].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(adv[6:9], torch.tensor([1.1547, -0.5774, -0.5774]), atol=1e-4, rtol=0)
    assert metrics["advantage/too_few_valid_frac"] == pytest.approx(1 / 5)


def test_prompt_stream_resumes():
    tok = load_tokenizer(None)
    a = PromptSource(task_pool("addition", 7, 0, 2), tok, seed=3)
    first = [p.text for p in a.take(10)]
    state = a.state_dict()
    rest = [p.text for p in a.take(6)]
    b = PromptSource(task_pool("addition", 7, 0, 2), tok, seed=3)
    b.load_state_dict(state)
    assert [p.text for p in b.take(6)] == rest and len(set(first[:7])) <= 7
    assert isinstance(b.take(1)[0], Prompt)


# ------------------------------------------------------------------------------------ end to end


def _e2e(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.runtime import run_rl
    from mcore_rl.runtime.loop import RLRun

    ckpt = os.path.join(tmp, "ckpt")
    # 1. three steps, checkpoint every 2
    a = tiny(f"run_dir={tmp}/a", f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2")
    summary = run_rl(a)
    recs = _records(f"{tmp}/a")
    opt = a.optimizer_steps_per_rollout
    assert [r["step"] for r in recs] == list(range(0, 3 * opt + 1))  # step 0: the evaluation before RL
    for r in recs[1:]:
        for key in ("step", "reward/mean", "mismatch/k3", "train/loss", "rollout/policy_version_min"):
            assert key in r, key
        # the samples of rollout step k were made with weight version k (version 1 = the first sync)
        assert r["rollout/policy_version_min"] == r["rollout/policy_version_max"] == r["rl_step"]
        assert r["mismatch/k3"] >= 0
    evals = [r for r in recs if "eval/score" in r]
    assert [r["rl_step"] for r in evals] == [0, 2, 3]
    assert {"eval/greedy_pass@1", "eval/avg@2", "eval/pass@2"} <= set(evals[-1])
    assert summary["eval_after"]["eval/score"] == evals[-1]["eval/score"]
    assert os.path.exists(f"{tmp}/a/curves.png") and os.listdir(f"{tmp}/a/tensorboard")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000003", "latest"]

    # 2. resume from the step-2 checkpoint: continues at rollout step 3 / optimizer step 2*opt+1,
    #    on the same prompts, with the numbers the uninterrupted run had. Its run_dir holds what a
    #    kill after logging step 3 but before saving it leaves: step 3's records and a torn line;
    #    they are dropped, so each step is logged once.
    os.makedirs(f"{tmp}/b")
    with open(f"{tmp}/a/metrics.jsonl") as src, open(f"{tmp}/b/metrics.jsonl", "w") as dst:
        dst.write(src.read() + '{"step": 99, "rl_st')
    b = tiny(f"run_dir={tmp}/b", f"checkpoint.load_dir={ckpt}/iter_0000002")
    run_rl(b)
    resumed = _records(f"{tmp}/b")
    assert [r["step"] for r in resumed] == list(range(0, 3 * opt + 1))
    assert resumed[: 2 * opt + 1] == recs[: 2 * opt + 1] and all(r["rl_step"] == 3 for r in resumed[2 * opt + 1 :])
    measured = ("time/", "perf/", "ttfs/")  # wall-clock figures: the resumed run's first step has its ttfs/*
    for x, y in zip(resumed[2 * opt + 1 :], recs[-opt:]):
        assert {k for k in x if not k.startswith(measured)} == {k for k in y if not k.startswith(measured)}
        for key in ("reward/mean", "rollout/policy_version_min", "response/length_mean"):
            assert x[key] == y[key], key
        for key in x:
            if not key.startswith(measured):
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key

    # 3. provenance, checked on the samples themselves
    run = RLRun(tiny(f"run_dir={tmp}/c"))
    try:
        run.initialise()
        samples, _ = run.rollouts()
        assert len(samples) == 16 and run.state.version == 1
        for s in samples:
            assert s.policy_version == 1 and s.engine == "embedded:0"
            assert len(s.rollout_logp) == len(s.response_ids) > 0 and all(lp <= 0 for lp in s.rollout_logp)
            assert s.provenance()["prompt_index"] == s.prompt.index
        assert len({s.prompt.index for s in samples}) == 4
    finally:
        run.close()

    # 4. the other paths: MIPU (accept/reject + re-sync), KL to a reference (with its checkpoint),
    #    entropy bonus, dynamic sampling, seq-level aggregation, two PPO epochs
    d = tiny(
        f"run_dir={tmp}/d",
        "train.num_steps=2",
        "algorithm.mismatch.name=mipu",
        "algorithm.mismatch.mipu_validation_prompts=2",
        "algorithm.kl_coef=0.05",
        "algorithm.entropy_coef=0.01",
        "algorithm.dynamic_sampling.enabled=true",
        "algorithm.dynamic_sampling.max_rounds=2",
        "algorithm.loss_agg=seq-mean-token-mean",
        "algorithm.ppo_epochs=2",
        "init.sft_steps=30",
        f"checkpoint.save_dir={tmp}/ckpt_d",
        "eval.at_start=false",
    )
    run_rl(d)
    recs = _records(f"{tmp}/d")
    last = [r for r in recs if "mipu/accepted" in r]
    assert len(last) == 2 and all(r["mipu/accepted"] in (0.0, 1.0) for r in last)
    # Step 2's noise is logged with each decision (2 validation groups: a finite SE)
    for r in last:
        assert r["mipu/validation_groups"] == 2 and 0 <= r["mipu/informative_groups"] <= 2
        assert r["mipu/t_post_se"] >= 0 and 0 <= r["mipu/flip_prob"] <= 0.5 and 0 <= r["mipu/bootstrap_flip_rate"] <= 1
    assert all("kl/ref" in r and "entropy/loss" in r for r in recs)
    # a rejected update re-syncs the restored weights as a new version
    assert last[-1]["rollout/weight_version"] == 1 + 2 + sum(1 - r["mipu/accepted"] for r in last)
    assert os.path.exists(f"{tmp}/ckpt_d/reference/latest")
    # resuming a KL run finds the reference weights next to the checkpoints
    e = tiny(
        f"run_dir={tmp}/e",
        "train.num_steps=3",
        "algorithm.kl_coef=0.05",
        f"checkpoint.load_dir={tmp}/ckpt_d",
        "eval.interval=0",
    )
    run_rl(e)
    assert [r["rl_step"] for r in _records(f"{tmp}/e")] == [3, 3]


def test_three_step_end_to_end_run_and_resume(tmp_path):
    run_world(1, _e2e, str(tmp_path))


def _http(rank: int, world_size: int, tmp: str) -> None:
    """The engine-URL path: a `mcore-rl serve`-style server (FP8) in this process, weights synced
    over `/update_weights_from_tensor`, rollouts over `/generate`."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.driver import EngineDriver
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.server import EngineServer, ServerThread
    from mcore_rl.runtime import run_rl

    cfg = tiny(f"run_dir={tmp}/http", "train.num_steps=2", "eval.interval=0", "eval.at_start=false")
    core = EngineCore(
        McoreRLForCausalLM(hf_config_from_model_config(cfg.model)),
        load_tokenizer(None),
        context_length=64,
        quantization="fp8",
    )
    server = ServerThread(EngineServer(EngineDriver(core)))
    url = server.start()
    try:
        cfg.rollout.engine_urls = [url]
        run_rl(cfg)
    finally:
        server.stop()
    recs = _records(f"{tmp}/http")
    assert [r["rl_step"] for r in recs] == [1, 1, 2, 2]
    assert all(r["rollout/policy_version_min"] == r["rl_step"] for r in recs)
    assert core.weight_version == 3  # initial sync + one per step
    assert recs[-1]["mismatch/k3"] > 0  # FP8 engine vs fp32 trainer


def test_engine_url_path_with_http_weight_sync(tmp_path):
    run_world(1, _http, str(tmp_path))


def _tp2(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.runtime import run_rl

    cfg = tiny(
        f"run_dir={tmp}/tp2",
        "parallel.tensor_model_parallel_size=2",
        "train.num_steps=2",
        "eval.interval=0",
        "algorithm.kl_coef=0.01",
    )
    summary = run_rl(cfg)
    assert summary["state"]["rl_step"] == 2
    if rank == 0:
        recs = _records(f"{tmp}/tp2")
        assert [r["rl_step"] for r in recs] == [0, 1, 1, 2, 2] and "eval/score" in recs[-1]


@pytest.mark.slow
def test_tp2_short_run(tmp_path):
    run_world(2, _tp2, str(tmp_path))
