"""Log-probs and entropy only at the tokens that are trained (`token_mask` / the `stats_mask` key):
the values and gradients at the kept tokens equal the full computation's, one rank and TP=2."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.train.logprobs import vocab_parallel_topk_stats
from mcore_rl.train.packing import build_microbatches
from tests.world import run_world

N, H, V = 29, 8, 40


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    keep = torch.rand(N, generator=g) < 0.4  # e.g. the model's turns between observations
    keep[0], keep[-1] = False, True
    coef = torch.randn(3, N, generator=g)
    topk = torch.randint(0, V, (N, 3), generator=g)
    counts = torch.randint(0, 4, (N,), generator=g)  # sampling-mask supports (0 = full vocabulary)
    mask_ids = torch.randint(0, V, (int(counts.sum()),), generator=g)
    return hidden, weight, targets, keep, coef, topk, counts, mask_ids


def _stats(hidden, weight, targets, keep, coef, *, topk=None, counts=None, mask_ids=None, group=None, shard=(0, V)):
    """Values at the kept tokens and the gradients of a loss over them (restricted when `keep` is
    passed as token_mask, else computed everywhere and masked afterwards)."""
    h = hidden.clone().requires_grad_()
    w = weight[shard[0] : shard[1]].clone().requires_grad_()
    lp, ent, tk = vocab_parallel_topk_stats(
        h, w, targets, topk, 0.8, 5, True, group, mask_ids=mask_ids, mask_counts=counts, token_mask=keep
    )
    m = keep.float() if keep is not None else None
    return lp, ent, tk, h, w, m


def _compare(case, group=None, shard=(0, V), **extra) -> None:
    hidden, weight, targets, keep, coef, *_ = case
    full_lp, full_ent, full_tk, fh, fw, _ = _stats(
        hidden, weight, targets, None, coef, group=group, shard=shard, **extra
    )
    kept_lp, kept_ent, kept_tk, kh, kw, _ = _stats(
        hidden, weight, targets, keep, coef, group=group, shard=shard, **extra
    )
    m = keep.float()
    for lp, ent, tk in ((full_lp, full_ent, full_tk), (kept_lp, kept_ent, kept_tk)):
        (m * (coef[0] * lp + coef[1] * ent + coef[2] * tk.sum(-1))).sum().backward()
    torch.testing.assert_close(kept_lp[keep], full_lp[keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kept_ent[keep], full_ent[keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kept_tk[keep], full_tk[keep], rtol=1e-6, atol=1e-6)
    assert not kept_lp[~keep].any() and not kept_ent[~keep].any()  # never computed there
    torch.testing.assert_close(kh.grad, fh.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kw.grad, fw.grad, rtol=1e-5, atol=1e-6)


def test_kept_tokens_match_the_full_computation() -> None:
    case = _case()
    hidden, weight, targets, keep, coef, topk, counts, mask_ids = case
    _compare(case, topk=topk)
    _compare(case, counts=counts, mask_ids=mask_ids)  # sampling-mask replay: the kept tokens' supports
    no_token = (hidden, weight, targets, torch.zeros(N, dtype=torch.bool), coef)
    lp, ent, _tk, h, w, _ = _stats(*no_token)
    assert lp.shape == (N,) and not lp.any() and not ent.any()


def _tp_world(rank: int, world_size: int) -> None:
    case = _case(seed=4)
    per = V // world_size
    shard = (rank * per, (rank + 1) * per)
    _compare(case, group=dist.group.WORLD, shard=shard, topk=case[5])
    _compare(case, group=dist.group.WORLD, shard=shard, counts=case[6], mask_ids=case[7])


def test_kept_tokens_match_at_tp2() -> None:
    run_world(2, _tp_world)


def test_packing_marks_only_the_trained_response_tokens() -> None:
    single = Sample(Prompt(0, "a", [1, 2, 3]), 0, [4, 5], [-0.1, -0.2], 0, "stop")
    episode = Sample(
        Prompt(1, "b", [6, 7]), 1, [8, 9, 9, 10], [-0.3, 0.0, 0.0, -0.4], 0, "stop", trainable=[1, 0, 0, 1]
    )
    (mb,) = build_microbatches([single, episode], [0, 1], 16, 2, 0, 1, 0, 4)
    # both packed into row 0: [1 2 3 4 5 | 6 7 8 9 9 10]; label t predicts token t + 1
    want = torch.zeros(16, dtype=torch.bool)
    want[[2, 3, 6, 9]] = True  # 4, 5 of the first; 8 and 10 of the episode, not its observation 9 9
    assert mb["stats_mask"].dtype == torch.bool and torch.equal(mb["stats_mask"][0], want)
    assert not mb["stats_mask"][1:].any()
    assert mb["loss_mask"][0].sum() == 6  # the loss mask still covers every response token
