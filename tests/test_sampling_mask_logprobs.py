"""Sampling-mask replay, trainer side: the chunked vocab-parallel log-probs and entropy renormalised
over each token's support — against the definition (values, fp64 gradcheck of the masked backward),
and a megatron-core model at TP=1 and TP=2 against the embedded engine's processed log-probs."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.train.logprobs import seq_major_masks, vocab_parallel_topk_stats
from tests.world import run_world


def _supports(n: int, vocab: int, y: torch.Tensor, seed: int) -> list[list[int]]:
    """Random supports holding the target; every third token has none (full vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append([])
            continue
        k = int(torch.randint(1, vocab // 2, (1,), generator=g))
        ids = set(torch.randperm(vocab, generator=g)[:k].tolist()) | {int(y[i])}
        out.append(sorted(ids))
    return out


def _flat(supports: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([i for s in supports for i in s], dtype=torch.int32),
            torch.tensor([len(s) for s in supports], dtype=torch.int32))


def _naive(hidden, weight, y, supports, temperature):
    z = (hidden @ weight.t()) / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    for i, s in enumerate(supports):
        if s:
            keep[i] = False
            keep[i, s] = True
    logsm = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    p = logsm.exp()
    ent = -(p * torch.where(keep, logsm, torch.zeros_like(logsm))).sum(-1)
    return logsm.gather(1, y[:, None]).squeeze(1), ent


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_masked_gradcheck_and_values(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, vocab = 13, 5, 11
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)
    supports = _supports(n, vocab, y, 1)
    supports[0] = [int(y[0])]  # a singleton: log-prob 0, entropy 0, zero gradient
    ids, counts = _flat(supports)

    def f(hh, ww):
        lp, ent, _ = vocab_parallel_topk_stats(hh, ww, y, None, 0.7, chunk, True, None, ids, counts)
        return lp, ent

    assert torch.autograd.gradcheck(f, (hidden, weight))
    lp, ent = f(hidden, weight)
    want_lp, want_ent = _naive(hidden, weight, y, supports, 0.7)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
    assert float(lp[0].detach()) == 0.0 and abs(float(ent[0].detach())) < 1e-15
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    # the masked statistics really differ from the full-vocabulary ones where a support is given
    full_lp, _, _ = vocab_parallel_topk_stats(hidden, weight, y, None, 0.7, chunk, True, None)
    assert bool((lp[1:] - full_lp[1:]).abs()[[i - 1 for i in range(1, n) if supports[i]]].min() > 1e-6)
    torch.testing.assert_close(lp[2], full_lp[2])  # no support: the full distribution


def test_masked_logprob_only_backward_fp32_and_refusals() -> None:
    g = torch.Generator().manual_seed(4)
    n, h, vocab = 20, 8, 40
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(vocab, h, generator=g).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)
    supports = _supports(n, vocab, y, 2)
    ids, counts = _flat(supports)
    lp, ent, _ = vocab_parallel_topk_stats(hidden, weight, y, None, 1.0, 3, False, None, ids, counts)
    lp.sum().backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    _naive(h2, w2, y, supports, 1.0)[0].sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mask_ids: expected"):
        vocab_parallel_topk_stats(hidden, weight, y, None, 1.0, 3, False, None, ids[:-1], counts)
    with pytest.raises(ValueError, match="top-k ids"):
        vocab_parallel_topk_stats(hidden, weight, y, torch.zeros(n, 2, dtype=torch.long), 1.0, 3, False, None,
                                  ids, counts)


def test_seq_major_masks_reorders_segments() -> None:
    counts = torch.tensor([[1, 0, 2], [3, 1, 0]])
    ids = torch.tensor([10, 20, 21, 30, 31, 32, 40])  # row-major: (0,0) (0,2)x2 (1,0)x3 (1,1)
    new_ids, new_counts = seq_major_masks(ids, counts)
    # seq-major order: (0,0) (1,0) (0,1) (1,1) (0,2) (1,2)
    assert new_counts.tolist() == [1, 3, 0, 1, 2, 0]
    assert new_ids.tolist() == [10, 30, 31, 32, 40, 20, 21]
