"""The critic in the RL run (train/critic.py, algos/critic.py) and the advantages that read it: PPO's
token-level GAE (`gae`, algos/gae.py) and StepPO's step-level GAE (`steppo`, algos/steppo.py).

Pure functions against hand values and closed forms; the learner with a real megatron-core critic in
spawned gloo worlds (one rank: the critic fits, the learner's advantages are the pure functions of its
values, the warm-up freezes the policy; two ranks at TP=2, PP=2 and DP=2 against the one-rank
numbers; a reward model of `mcore-rl rm-train` as its starting point); real RL runs end to end with
`gae` on the demo recipe (checkpoint and resume restore the critic) and `steppo` on the agentic
demo's step-wise guess-the-number.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.critic import (
    ValueBatch,
    critic_targets,
    explained_variance,
    takes_values,
    value_loss,
    whiten,
)
from mcore_rl.algos.gae import gae, token_gae
from mcore_rl.algos.multi_reward import option_problems
from mcore_rl.algos.step_credit import StepBatch
from mcore_rl.algos.steppo import step_gae, steppo
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from tests.helpers import ROOT, tiny
from tests.test_bench_step_credit import _bench
from tests.world import run_world

# ------------------------------------------------------------------------------------ pure functions


def test_registered_and_read_the_critic() -> None:
    assert algos.get("advantage", "gae") is gae and algos.get("advantage", "steppo") is steppo
    assert takes_values(gae) and takes_values(steppo) and not takes_values(algos.get("advantage", "grpo"))
    assert critic_targets(gae) is not critic_targets(steppo)


def test_clipped_value_loss_against_hand_values() -> None:
    v = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # position 0: V moved 0.5 from V_old, clipped to 0.7 at ε 0.2: max((1-2)², (0.7-2)²) = 1.69
    # position 1: V = V_old: (0-1)² = 1; position 2 is masked
    loss, count, m = value_loss(v, old, ret, mask, clip=0.2, coef=0.5)
    assert float(loss.detach()) == pytest.approx(0.5 * (1.69 + 1.0)) and float(count) == 2
    assert float(m["clipfrac"]) == pytest.approx(0.5)
    loss.backward()
    # the clipped term wins at position 0: no gradient through V there; position 1: c·2(V − R) = −1
    assert v.grad is not None and v.grad.tolist() == [[0.0, -1.0, 0.0]]
    unclipped, _, m = value_loss(v, old, ret, mask, clip=None, coef=1.0)
    assert float(unclipped.detach()) == pytest.approx(2.0) and float(m["clipfrac"]) == 0.0
    # the clip is pessimistic: V that moved past ε, even towards the return, pays (V_clip − R)²
    toward, _, m = value_loss(torch.tensor([[1.9]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    assert float(toward) == pytest.approx(0.5 * (2.0 - 0.2) ** 2) and float(m["clipfrac"]) == 1.0


def test_explained_variance_and_whitening() -> None:
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ones = torch.ones(4)
    assert explained_variance(r, r, ones) == 1.0
    assert explained_variance(torch.zeros(4), r, ones) == pytest.approx(0.0)
    assert explained_variance(r.mean().expand(4), r, ones) == pytest.approx(0.0)
    assert math.isnan(explained_variance(torch.zeros(4), torch.ones(4), ones))  # returns that do not vary
    a = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w = whiten(a, m, normalize_std=False)
    assert w.tolist() == [[-2.0, 0.0], [2.0, 0.0]]
    w = whiten(a, m, normalize_std=True)
    assert float(w[m.bool()].mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(w[m.bool()].std()) == pytest.approx(1.0, rel=1e-5)


def _gae_loop(r: float, v: list[float], gamma: float, lam: float) -> list[float]:
    out, running = [0.0] * len(v), 0.0
    for t in reversed(range(len(v))):
        nxt = v[t + 1] if t + 1 < len(v) else 0.0
        running = (r if t == len(v) - 1 else 0.0) + gamma * nxt - v[t] + gamma * lam * running
        out[t] = running
    return out


def test_token_gae_is_the_closed_form() -> None:
    v = torch.tensor([[0.3, -0.2, 0.5, 0.1], [0.4, 0.6, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    r = torch.tensor([1.0, -0.5])
    # λ = 1, γ = 1: Â_t = R − V_t (the Monte-Carlo return); λ = 0: the one-step TD residual
    adv, ret = token_gae(r, v, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, ((r[:, None] - v) * mask).double())
    torch.testing.assert_close(ret, (r[:, None] * mask).double())
    adv, _ = token_gae(r, v, mask, 1.0, 0.0)
    want0 = torch.tensor([[-0.5, 0.7, -0.4, 0.9], [0.2, -1.1, 0.0, 0.0]]).double()
    torch.testing.assert_close(adv, want0)
    # general γ, λ: Σ_l (γλ)^l δ_{t+l}
    adv, ret = token_gae(r, v, mask, 0.9, 0.8)
    torch.testing.assert_close(adv[0], torch.tensor(_gae_loop(1.0, v[0].tolist(), 0.9, 0.8)).double())
    torch.testing.assert_close(adv[1, :2], torch.tensor(_gae_loop(-0.5, v[1, :2].tolist(), 0.9, 0.8)).double())
    torch.testing.assert_close(ret, (adv + v.double()) * mask.double())
    # an observation token (trainable 0) between two action tokens is skipped: as if it were not there
    gap = torch.tensor([[0.3, 9.0, -0.2, 0.5]])
    adv_gap, _ = token_gae(torch.tensor([1.0]), gap, torch.tensor([[1.0, 0.0, 1.0, 1.0]]), 0.9, 0.8)
    plain, _ = token_gae(torch.tensor([1.0]), torch.tensor([[0.3, -0.2, 0.5]]), torch.ones(1, 3), 0.9, 0.8)
    torch.testing.assert_close(adv_gap[0, [0, 2, 3]], plain[0])
    assert float(adv_gap[0, 1]) == 0.0


def test_gae_estimator_whitens_valid_tokens_and_its_targets_are_the_lambda_returns() -> None:
    v = torch.tensor([[0.3, -0.2, 0.5], [0.4, 0.6, 0.0], [0.1, 0.1, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    r = torch.tensor([1.0, -0.5, 3.0])
    valid = torch.tensor([True, True, False])
    vb = ValueBatch(v, mask)
    gids = torch.tensor([0, 0, 1])
    adv = gae(r, gids, values=vb, valid=valid, gamma=0.9, lam=0.8, normalize_std=False)
    raw, ret = token_gae(r[:2], v[:2], mask[:2], 0.9, 0.8)
    sel = mask[:2].bool()
    torch.testing.assert_close(adv[:2][sel].double(), (raw[sel] - raw[sel].mean()), rtol=1e-6, atol=1e-6)
    assert torch.equal(adv[2], torch.zeros(3)) and float(adv[1, 2]) == 0.0
    returns, where = critic_targets(gae)(r, gids, values=vb, valid=valid, gamma=0.9, lam=0.8)
    torch.testing.assert_close(returns[:2], ret.float())
    assert torch.equal(where[2], torch.zeros(3))
    with pytest.raises(ValueError, match="critic"):
        gae(r, gids)


def test_steppo_reads_each_steps_last_state_token() -> None:
    # two episodes of two steps in one group; values at column 0 (the last prompt token) only count
    steps = StepBatch(
        torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]), torch.arange(4), torch.tensor([0.0, 1.0, 0.0, 0.0])
    )
    r = torch.tensor([1.0, 1.0, 0.0, 0.0])
    gids = torch.zeros(4, dtype=torch.long)
    v0 = torch.tensor([0.4, 0.7, 0.2, 0.1])
    vals = torch.stack([v0, torch.full((4,), 5.0)], 1)  # column 1 (a later action token) must not matter
    vb = ValueBatch(vals, torch.ones(4, 2))
    raw = step_gae(r, gids, steps, v0, 0.9, 0.8)
    adv = steppo(r, gids, steps=steps, values=vb, gamma=0.9, lam=0.8, normalize_std=False)
    torch.testing.assert_close(adv.double(), raw - raw.mean())
    # T = 1, λ = 1, terminal value 0: Â = r − V(s)
    one = StepBatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([0.7]))
    single = ValueBatch(torch.tensor([[0.25, 3.0]]), torch.ones(1, 2))
    assert float(step_gae(torch.tensor([0.7]), torch.tensor([0]), one, torch.tensor([0.25]), 0.9, 1.0)[0]) == (
        pytest.approx(0.45)
    )
    returns, where = critic_targets(steppo)(
        torch.tensor([0.7]), torch.tensor([0]), values=single, steps=one, gamma=0.9, lam=1.0
    )
    assert returns.tolist() == [[pytest.approx(0.7), 0.0]] and where.tolist() == [[1.0, 0.0]]
    returns, where = critic_targets(steppo)(r, gids, values=vb, steps=steps, valid=torch.tensor([1, 1, 1, 0]).bool())
    torch.testing.assert_close(returns[:, 0].double(), (step_gae(r, gids, steps, v0, 0.99, 0.95) + v0).float().double())
    assert where[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0] and float(where[:, 1].abs().sum()) == 0.0


def test_options_and_config_keys_are_validated_with_their_dotted_key(tmp_path) -> None:
    assert option_problems("advantage", "gae", {"lam": 1.5})[0][0] == "lam"
    assert option_problems("advantage", "steppo", {"gamma": 0.0})[0][0] == "gamma"
    assert option_problems("advantage", "gae", {"gamma": 0.99, "lam": 0.9}) == []

    def errors(*overrides: str, path: str | None = None) -> str:
        cfg = load_config(RLConfig, path, list(overrides)) if path else tiny(*overrides)
        try:
            validate_rl_config(cfg, 1)
        except ConfigError as e:
            return str(e)
        return ""

    assert errors("algorithm.advantage=gae", "algorithm.critic.lr=1e-4") == ""
    assert "algorithm.critic: is set, but algorithm.advantage 'grpo' reads no critic" in errors(
        "algorithm.critic.value_clip=0.5"
    )
    bad = errors(
        "algorithm.advantage=gae",
        "algorithm.critic.lr=0",
        "algorithm.critic.value_clip=-1",
        "algorithm.critic.loss_coef=0",
        "algorithm.critic.warmup_steps=3",
        f"algorithm.critic.init_checkpoint={tmp_path}/none",
    )
    for key in ("lr", "value_clip", "loss_coef", "warmup_steps", "init_checkpoint"):
        assert f"algorithm.critic.{key}:" in bad, key
    agentic = os.path.join(ROOT, "configs", "agentic_demo.yaml")
    assert errors("algorithm.advantage=steppo", "algorithm.policy_loss=gspo", path=agentic) == ""
    assert errors(*_bench().ARMS["steppo"], path=agentic) == ""  # benchmarks/bench_step_credit.py's arm
    assert "data.domains[0].environment.trajectory: is 'stepwise', but algorithm.advantage 'gae'" in errors(
        "algorithm.advantage=gae", path=agentic
    )
    assert "'steppo' is a step-level estimator" in errors("algorithm.advantage=steppo")


# ------------------------------------------------------------------------------- the learner's critic

LEARNER = ("algorithm.num_minibatches=1", "init.sft_steps=0", "train.micro_batch_size=4")


def _samples(tokenizer, steps: bool = False) -> list:
    """4 groups of 4; the reward depends on the prompt only (its group index), so a critic that reads
    the prompt can explain it. With `steps`: each group is 2 episodes of 2 steps."""
    from dataclasses import replace

    from mcore_rl.algos.step_credit import state_key
    from mcore_rl.data.samples import Prompt, Sample

    rng = random.Random(3)
    out = []
    for g in range(4):
        text = f"{g}+1="
        prompt = Prompt(index=g, text=text, ids=[tokenizer.bos_id] + tokenizer.encode(text))
        for j in range(4):
            n = rng.randint(2, 4)
            rsp = [rng.randrange(3, 40) for _ in range(n)]
            out.append(Sample(prompt, g, rsp, [-1.0] * n, policy_version=0, finish_reason="stop", reward=float(g)))
    if not steps:
        return out
    return [
        replace(
            x,
            episode=j % 4 // 2,
            step_index=j % 2,
            info={"state": st, "state_key": state_key(st), "step_reward": 0.0},
        )
        for j, x in enumerate(out)
        for st in ["start" if j % 2 == 0 else f"after {x.group}"]
    ]


def _learner(cfg: RLConfig, state_path: str | None = None, save: bool = False):
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.train.critic import build_critic
    from mcore_rl.train.policy import build_policy
    from mcore_rl.train.rl_step import Learner

    policy = build_policy(cfg, validate_rl_config, total_iters=100)
    if state_path is not None and save:
        full = gather_full_state_dict(policy.chunks)
        if torch.distributed.get_rank() == 0:
            torch.save(full, state_path)
    elif state_path is not None:
        load_full_state_dict(policy.chunks, torch.load(state_path))
    critic = build_critic(cfg, 100, policy.tokenizer.pad_id)
    critic.copy_policy(policy.chunks)
    return Learner(cfg, policy.chunks, policy.optimizer, None, policy.tokenizer.pad_id, critic=critic), policy


def _layout_numbers(learner, samples) -> dict[str, torch.Tensor]:
    """Values, advantages, one critic step's loss and the values after it."""
    per_seq, metrics = learner.prepare(samples)
    out = {k: per_seq[k].clone() for k in ("value_old", "value_returns", "value_mask", "advantages")}
    rec = learner.critic.train_part(samples, range(len(samples)), per_seq)
    out["loss"] = torch.tensor(rec["critic/value_loss"])
    out["after"] = learner.critic.values(samples, per_seq["value_old"].shape[1])
    return out


def _one_rank(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.agent.episodes import step_batch
    from mcore_rl.train.packing import sequence_view

    cfg = tiny("algorithm.advantage=gae", "algorithm.critic.lr=3e-3", *LEARNER)
    learner, policy = _learner(cfg, os.path.join(tmp, "policy.pt"), save=True)
    samples = _samples(policy.tokenizer)
    torch.save(_layout_numbers(learner, samples), os.path.join(tmp, "tp1.pt"))

    # the learner's advantages are the pure function of the critic's values; its targets the λ-returns
    per_seq, metrics = learner.prepare(samples)
    view = sequence_view(samples)
    vb = ValueBatch(per_seq["value_old"], view.mask)
    assert float(vb.values[view.mask == 0].abs().sum()) == 0.0
    torch.testing.assert_close(
        per_seq["advantages"], gae(view.rewards, view.group_ids, values=vb, valid=view.ok.bool())
    )
    _, want = token_gae(view.rewards, vb.values, view.mask, 1.0, 0.95)
    torch.testing.assert_close(per_seq["value_returns"], want.float())
    assert {"critic/explained_variance", "critic/value_mean", "critic/return_mean"} <= set(metrics)

    # the critic fits a reward it can read from the prompt: explained variance rises, the loss falls
    evs, losses = [], []
    for k in range(30):
        records, metrics = learner.train(samples, k)
        evs.append(metrics["critic/explained_variance"])
        losses.append(records[-1]["critic/value_loss"])
        assert math.isfinite(records[-1]["train/loss"])
    assert evs[0] < 0.2 and max(evs[-5:]) > 0.6, evs
    assert sum(losses[-5:]) < 0.3 * sum(losses[:5]), losses

    # StepPO through the learner: the critic at each step's last state token (column 0)
    learner.cfg = tiny("algorithm.advantage=steppo", "algorithm.advantage_options={gamma: 0.9}", *LEARNER)
    steps = _samples(policy.tokenizer, steps=True)
    per_seq, metrics = learner.prepare(steps)
    v = learner.critic.values(steps, per_seq["value_old"].shape[1])
    vb = ValueBatch(v * sequence_view(steps).mask, sequence_view(steps).mask)
    want = steppo(view.rewards, view.group_ids, steps=step_batch(steps), values=vb, valid=view.ok.bool(), gamma=0.9)
    torch.testing.assert_close(per_seq["advantages"], want)
    assert float(per_seq["value_mask"][:, 1:].sum()) == 0.0 and float(per_seq["value_mask"][:, 0].sum()) == 16
    records, _ = learner.train(steps, 40)
    assert math.isfinite(records[-1]["critic/value_loss"]) and records[-1]["train/skipped"] == 0.0

    # the warm-up: the critic steps, the policy does not
    learner.cfg = tiny("algorithm.advantage=gae", "algorithm.critic.warmup_steps=2", *LEARNER)
    before = [p.detach().clone() for p in policy.chunks[0].parameters()]
    critic_before = [p.detach().clone() for p in learner.critic.chunks[0].parameters()]
    records, _ = learner.train(samples, 1)
    assert records[-1]["train/critic_warmup"] == 1.0 and "critic/value_loss" in records[-1]
    assert all(torch.equal(a, b) for a, b in zip(before, policy.chunks[0].parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, learner.critic.chunks[0].parameters()))
    records, _ = learner.train(samples, 2)  # past the warm-up: the policy steps again
    assert "train/critic_warmup" not in records[-1]
    assert not all(torch.equal(a, b) for a, b in zip(before, policy.chunks[0].parameters()))


def _layouts(rank: int, world_size: int, tmp: str) -> None:
    """TP=2, then PP=2, then DP=2 on two ranks: the one-rank numbers each time."""
    from megatron.core import parallel_state

    want = torch.load(os.path.join(tmp, "tp1.pt"))
    for layout in (
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.tensor_model_parallel_size=1",  # DP = 2: each sample on one rank
    ):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        cfg = tiny("algorithm.advantage=gae", "algorithm.critic.lr=3e-3", layout, *LEARNER)
        learner, policy = _learner(cfg, os.path.join(tmp, "policy.pt"))
        got = _layout_numbers(learner, _samples(policy.tokenizer))
        for key, value in want.items():
            torch.testing.assert_close(
                got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{layout} rank {rank} {key}: {m}"
            )


@pytest.mark.slow
def test_critic_fits_and_feeds_gae_and_steppo_and_tp_pp_dp_match_one_rank(tmp_path) -> None:
    run_world(1, _one_rank, str(tmp_path))
    run_world(2, _layouts, str(tmp_path))


# ------------------------------------------------------------------------------------------ end to end


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# the demo recipes cut to seconds: a tiny model, a few prompts, no warm start beyond a few steps
SHORT = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "train.num_steps=3",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "eval.interval=0",
    "eval.num_prompts=4",
    "eval.k=2",
    "eval.at_start=false",
    "init.sft_steps=5",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "reward.max_concurrency=1",
]


def _e2e(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.runtime import run_rl

    demo = os.path.join(ROOT, "configs", "demo.yaml")
    ckpt = os.path.join(tmp, "ckpt")
    gae_run = SHORT + ["algorithm.advantage=gae", "algorithm.critic.lr=1e-3", "rollout.quantization=none"]
    a = load_config(
        RLConfig, demo, gae_run + [f"run_dir={tmp}/a", f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2"]
    )
    run_rl(a)
    recs = _records(f"{tmp}/a")
    assert [r["rl_step"] for r in recs] == [1, 1, 2, 2, 3, 3]
    for r in recs:
        for key in ("critic/value_loss", "critic/explained_variance", "critic/value_mean", "train/loss"):
            assert key in r and math.isfinite(r[key]), key
    assert sorted(os.listdir(os.path.join(ckpt, "critic"))) == ["iter_0000002", "iter_0000003", "latest"]
    # resume at step 2: step 3 is the uninterrupted run's, critic included (a fresh critic would not be)
    b = load_config(RLConfig, demo, gae_run + [f"run_dir={tmp}/b", f"checkpoint.load_dir={ckpt}/iter_0000002"])
    run_rl(b)
    resumed = [r for r in _records(f"{tmp}/b") if r["rl_step"] == 3]
    for x, y in zip(resumed, recs[-2:]):
        for key in ("reward/mean", "critic/value_mean", "critic/value_loss", "critic/explained_variance", "train/loss"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key

    # StepPO on the agentic demo's step-wise guess-the-number (its critic warms up one step)
    agentic = os.path.join(ROOT, "configs", "agentic_demo.yaml")
    c = load_config(
        RLConfig,
        agentic,
        SHORT
        + [
            f"run_dir={tmp}/c",
            "train.num_steps=2",
            "train.micro_batch_size=8",
            "algorithm.advantage=steppo",
            "algorithm.policy_loss=gspo",
            "algorithm.critic.warmup_steps=1",
            "data.domains[0].eval.num_prompts=4",
        ],
    )
    run_rl(c)
    recs = _records(f"{tmp}/c")
    assert [r["rl_step"] for r in recs] == [1, 1, 2, 2]
    assert all(r["train/critic_warmup"] == 1.0 for r in recs[:2]) and "train/critic_warmup" not in recs[-1]
    assert all(math.isfinite(r["critic/value_loss"]) and "critic/explained_variance" in r for r in recs)


@pytest.mark.slow
def test_gae_on_the_demo_resumes_its_critic_and_steppo_runs_on_guess_the_number(tmp_path) -> None:
    run_world(1, _e2e, str(tmp_path))


def _from_value_model(rank: int, world_size: int, tmp: str) -> None:
    """A reward model trained by `mcore-rl rm-train` (one head) is a critic's starting point."""
    from megatron.core import parallel_state

    from mcore_rl.config.rm_schema import RMConfig
    from mcore_rl.models.shards import unwrap_model
    from mcore_rl.train import reward_model
    from mcore_rl.train.critic import build_critic

    rl = tiny("algorithm.advantage=gae", f"algorithm.critic.init_checkpoint={tmp}", *LEARNER)
    model = [f"model.{k}={getattr(rl.model, k)}" for k in MODEL_KEYS]

    def train_rm(name: str, heads: int) -> list[str]:
        run = [f"run_dir={tmp}/{name}", "train.train_iters=1", "train.micro_batch_size=2", "train.global_batch_size=2"]
        run += ["train.seq_length=16", "train.eval_interval=0", "data.synthetic_num_examples=16"]
        run += [f"reward_model.num_heads={heads}", f"checkpoint.save_dir={tmp}/{name}_ckpt"]
        reward_model.run_rm(load_config(RMConfig, None, model + run))
        parallel_state.destroy_model_parallel()
        return model + run

    one_head = train_rm("rm", 1)
    train_rm("rm_2", 2)
    loaded = reward_model.build_trainer(load_config(RMConfig, None, [*one_head, f"checkpoint.load_dir={tmp}/rm_ckpt"]))
    critic = build_critic(rl, 10, 0)
    critic.load_value_model(f"{tmp}/rm_ckpt")
    theirs = dict(unwrap_model(loaded.chunks[0]).named_parameters())
    mine = dict(unwrap_model(critic.chunks[0]).named_parameters())
    assert set(mine) == set(theirs)
    for name, p in mine.items():
        assert torch.equal(p, theirs[name]), name
    with pytest.raises(ValueError, match="not a value model with one head"):
        critic.load_value_model(f"{tmp}/rm_2_ckpt")


MODEL_KEYS = (
    "hidden_size",
    "ffn_hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "max_position_embeddings",
)


@pytest.mark.slow
def test_the_critic_starts_from_a_reward_models_checkpoint(tmp_path) -> None:
    run_world(1, _from_value_model, str(tmp_path))
