"""The learner with multi-domain, multi-reward advantages in a spawned DP=2 gloo world.

The learner holds the whole batch on every rank, so group and domain statistics need no reduction;
what has to hold is that the advantages each data-parallel rank trains with — those in its
micro-batches — are the ones of the whole batch, identical on both ranks, and not what the rank's
own share would give (the negative control shows the check can fail). One optimizer step then
runs with reward shaping, TMN-Reweight and per-domain weights, with the same per-domain metrics on
both ranks.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tests.helpers import tiny
from tests.world import run_world

OPTIONS = [
    "algorithm.advantage=golongrl",
    "algorithm.advantage_options={alpha: 0.6}",
    "algorithm.reward_shaping=[{name: alp, domains: [math], options: {beta: 0.05, correct_head: correct}},"
    " {name: cgpo_judges, domains: [chat], options: {judges: [safe]}}]",
    "algorithm.domain_advantage_weights={chat: 0.5}",
    "algorithm.num_minibatches=2",
    "train.micro_batch_size=2",
    "init.sft_steps=0",
    "algorithm.mismatch.name=tis",
]


def _samples(tokenizer) -> list:
    """Three math and three chat prompts, four samples each, with their reward heads."""
    from mcore_rl.data.samples import Prompt, Sample

    rng = random.Random(5)
    out = []
    for g in range(6):
        domain = "math" if g % 2 == 0 else "chat"
        text = f"{g}+{g}="
        prompt = Prompt(index=g, text=text, ids=[tokenizer.bos_id] + tokenizer.encode(text), domain=domain)
        for _ in range(4):
            n = rng.randint(1, 4)
            rsp = [rng.randrange(3, 60) for _ in range(n)]
            if domain == "math":
                heads = {"correct": float(rng.random() < 0.5)}
                reward = heads["correct"]
            else:
                heads = {"helpful": round(rng.random(), 2), "safe": float(rng.random() < 0.7)}
                reward = heads["helpful"]
            out.append(
                Sample(
                    prompt,
                    g,
                    rsp,
                    [-1.0] * n,
                    policy_version=0,
                    finish_reason="stop",
                    reward=reward,
                    reward_heads=heads,
                )
            )
    out[5].reward_error = "timeout after 2s"  # left out of the statistics
    return out


def _whole_batch_advantages(cfg, samples) -> torch.Tensor:
    """What one rank holding the whole batch computes, written out with the pure functions."""
    from mcore_rl.algos.alp import alp
    from mcore_rl.algos.cgpo import cgpo_judges, weight_domains
    from mcore_rl.algos.golongrl import golongrl
    from mcore_rl.train.packing import sequence_view

    v = sequence_view(samples)
    valid = v.ok.bool()
    math_, chat = v.domain_names.index("math"), v.domain_names.index("chat")
    common = dict(valid=valid, domain_ids=v.domain_ids, reward_heads=v.reward_heads, head_names=v.head_names)
    lengths = v.mask.sum(1).long()
    r = torch.where(
        v.domain_ids == math_,
        alp(v.rewards, v.group_ids, lengths=lengths, beta=0.05, correct_head="correct", **common),
        v.rewards,
    )
    r = torch.where(v.domain_ids == chat, cgpo_judges(r, v.group_ids, lengths=lengths, judges=["safe"], **common), r)
    adv = golongrl(r, v.group_ids, alpha=0.6, **common)
    return weight_domains(adv, v.domain_ids, v.domain_names, {"chat": 0.5})


def _world(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.config import validate_rl_config
    from mcore_rl.train.packing import build_microbatches, sequence_view, split_minibatches
    from mcore_rl.train.policy import build_policy
    from mcore_rl.algos.cgpo import weight_domains
    from mcore_rl.algos.golongrl import golongrl
    from mcore_rl.train.rl_step import Learner, shaped_rewards

    cfg = tiny(*OPTIONS)
    policy = build_policy(cfg, validate_rl_config, total_iters=4)
    assert ps.get_data_parallel_world_size() == 2
    learner = Learner(cfg, policy.chunks, policy.optimizer, None, policy.tokenizer.pad_id)
    box = [_samples(policy.tokenizer) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # as the loop does: rank 0's samples on every rank
    samples = box[0]
    n = len(samples)

    per_seq, metrics = learner.prepare(samples)
    want = _whole_batch_advantages(cfg, samples)
    torch.testing.assert_close(per_seq["advantages"], want, rtol=0, atol=0)
    assert bool(want[5] == 0) and bool((want != 0).sum() > n // 2)
    both = [None, None]
    dist.all_gather_object(both, (per_seq["advantages"], metrics))
    assert torch.equal(both[0][0], both[1][0]) and both[0][1].keys() == both[1][1].keys()
    for key in both[0][1]:
        if key.startswith("advantage/"):
            assert both[0][1][key] == both[1][1][key], key
    assert metrics["advantage/chat/samples"] == 11 and metrics["advantage/math/samples"] == 12

    # the micro-batches each rank trains on (as Learner.train builds them) carry the whole batch's values
    t = cfg.train
    for part in split_minibatches(n, cfg.algorithm.num_minibatches, t.seed, 0, 0):
        mbs = build_microbatches(
            samples,
            part,
            t.seq_length,
            t.micro_batch_size,
            rank,
            world_size,
            policy.tokenizer.pad_id,
            per_seq["old_logp"].shape[1],
            per_seq,
        )
        mine = [(int(i), float(a)) for mb in mbs for i, a in zip(mb["seq_index"], mb["advantages"])]
        gathered = [None, None]
        dist.all_gather_object(gathered, mine)
        seen = sorted(i for share in gathered for i, _ in share)
        assert seen == sorted(part), (seen, part)  # every sample of the mini-batch on exactly one rank
        for share in gathered:
            for i, a in share:
                assert a == float(want[i]), (i, a, float(want[i]))
        # negative control: the statistics of this rank's share alone are not the batch's
        own = sorted(i for i, _ in gathered[rank])
        sub = [samples[i] for i in own]
        view = sequence_view(sub)
        valid = view.ok.bool()
        local = weight_domains(
            golongrl(
                shaped_rewards(cfg.algorithm, view, valid),
                view.group_ids,
                alpha=0.6,
                valid=valid,
                domain_ids=view.domain_ids,
            ),
            view.domain_ids,
            view.domain_names,
            cfg.algorithm.domain_advantage_weights,
        )
        assert own and not torch.allclose(local, want[own]), "a rank's share alone gave the batch's advantages"

    records, batch_metrics = learner.train(samples, 0)
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in records)
    assert batch_metrics["advantage/math/abs_mean"] > 0
    losses = [None, None]
    dist.all_gather_object(losses, [r["train/loss"] for r in records])
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_dp2_learner_trains_with_the_whole_batch_advantages() -> None:
    run_world(2, _world)
