"""Chunked, vocab-parallel log-probs and entropy: the autograd Function against plain
`log_softmax` (gradcheck in fp64), and megatron-core models in TP/SP/PP layouts against the
reference model on one rank (values and gradients)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.train.logprobs import auto_chunk_size, vocab_parallel_token_stats
from tests.helpers import DENSE, P
from tests.helpers import _logprob_reference
from tests.world import run_world
from tests.helpers import CHUNK, TEMPERATURE, _batches, _inputs, _loss, _naive


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_gradcheck_against_definition(temperature: float, chunk: int) -> None:
    hidden, weight, y = _inputs()

    def f(h, w):
        return vocab_parallel_token_stats(h, w, y, temperature=temperature, chunk_size=chunk)

    assert torch.autograd.gradcheck(f, (hidden, weight))
    lp, ent = f(hidden, weight)
    want_lp, want_ent = _naive(hidden, weight, y, temperature)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)


def test_fp32_matches_naive_values_and_grads_and_chunking_is_invisible() -> None:
    hidden, weight, y = _inputs(n=37, h=16, vocab=50, dtype=torch.float32, seed=3)
    coef = torch.randn(2, 37, generator=torch.Generator().manual_seed(9))
    results = []
    for chunk in (None, 1, 7, 37):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        lp, ent = vocab_parallel_token_stats(h, w, y, temperature=0.9, chunk_size=chunk)
        (coef[0] * lp + coef[1] * ent).sum().backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    lp, ent = _naive(h, w, y, 0.9)
    (coef[0] * lp + coef[1] * ent).sum().backward()
    want = (lp.detach(), ent.detach(), h.grad, w.grad)
    for got in results:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    for got in results[1:]:  # chunk boundaries only move work around
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))


def test_without_entropy_and_logprob_only_backward() -> None:
    hidden, weight, y = _inputs(dtype=torch.float32)
    lp, ent = vocab_parallel_token_stats(hidden, weight, y, with_entropy=False, chunk_size=3)
    assert not ent.requires_grad and bool((ent == 0).all())
    lp.sum().backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    _naive(h2, w2, y)[0].sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_give_fp32_stats_close_to_fp32() -> None:
    hidden, weight, y = _inputs(n=9, h=8, vocab=30, dtype=torch.float32, seed=5)
    lp32, ent32 = vocab_parallel_token_stats(hidden, weight, y)
    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    lp, ent = vocab_parallel_token_stats(hb, wb, y, chunk_size=4)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp32.detach(), rtol=0.05, atol=0.1)
    (lp.sum() + ent.sum()).backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16


def test_rejects_bad_temperature_and_auto_chunk() -> None:
    hidden, weight, y = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_token_stats(hidden, weight, y, temperature=0.0)
    assert auto_chunk_size(151_936) == 220  # 128 MiB / (4 B * 151936)
    assert auto_chunk_size(10**12) == 1


# --------------------------------------------------------------------------------------------
# megatron-core layouts vs the reference model (2-rank gloo world)
# --------------------------------------------------------------------------------------------

TIED = dataclasses.replace(DENSE, tie_word_embeddings=True)


def _check(mc, pc, batches, ref, results: dict) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp
    from mcore_rl.train.logprobs import compute_token_stats, make_forward_step

    ref_obj, ref_stats, ref_state, ref_grads = ref
    layout = init_model_parallel(pc)
    set_seed(1)
    config = transformer_config(mc, pc)
    chunks = build_model(mc, pc, config=config)
    load_full_state_dict(chunks, hf_to_megatron(ref_state, mc))
    chunks = wrap_ddp(chunks, config)
    prepare_config(config, chunks)
    per_rank = len(batches) // layout.dp
    first = ps.get_data_parallel_rank() * per_rank
    mine = batches[first : first + per_rank]
    name = f"{mc.arch} tied={mc.tie_word_embeddings} {pc}"

    store: list = []
    step = make_forward_step(_loss, temperature=TEMPERATURE, chunk_size=CHUNK, store=store)
    result = forward_backward(chunks, mine, forward_step=step)
    assert abs(result["loss"] - ref_obj) <= 1e-5 * abs(ref_obj) + 1e-7, f"{name}: {result['loss']} vs {ref_obj}"
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    assert len(store) == (per_rank if last else 0), name
    for i, report in enumerate(store):
        want_lp, want_ent = ref_stats[first + i]
        torch.testing.assert_close(report["logprobs"], want_lp, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name} lp {m}")
        torch.testing.assert_close(report["entropy"], want_ent, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name} ent {m}")

    grads = gather_full_state_dict(chunks, grads=True)
    expected = hf_to_megatron(ref_grads, mc)
    assert set(grads) == set(expected), f"{name}: {sorted(set(grads) ^ set(expected))}"
    for key, want in expected.items():
        scale = float(want.abs().max()) or 1.0
        torch.testing.assert_close(grads[key], want, rtol=1e-5, atol=2e-6 * scale, msg=lambda m: f"{name} {key}: {m}")
    results[name] = (result["loss"], grads)

    # forward-only (π_old / π_ref): same values on every stage
    fwd = compute_token_stats(chunks, mine, temperature=TEMPERATURE, chunk_size=CHUNK, with_entropy=True)
    assert len(fwd) == per_rank
    for i, st in enumerate(fwd):
        want_lp, want_ent = ref_stats[first + i]
        torch.testing.assert_close(st.logprobs, want_lp, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name} fwd lp {m}")
        torch.testing.assert_close(st.entropy, want_ent, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name} fwd ent {m}")


def _world(rank: int, world_size: int, cases) -> None:
    refs, batches, results = {}, {}, {}
    for mc, pc in cases:
        key = repr(mc)
        if key not in refs:
            batches[key] = _batches(mc.vocab_size)
            refs[key] = _logprob_reference(mc, batches[key])
        _check(mc, pc, batches[key], refs[key], results)
    # TP=1 vs TP=2 vs PP=2 directly (not only through the reference): same loss and grads.
    dense = [v for k, v in results.items() if "tied=False" in k]
    base_loss, base_grads = dense[0]
    for loss, grads in dense[1:]:
        assert abs(loss - base_loss) <= 1e-6 * abs(base_loss) + 1e-7
        for key, g in base_grads.items():
            scale = float(g.abs().max()) or 1.0
            torch.testing.assert_close(grads[key], g, rtol=1e-5, atol=2e-6 * scale, msg=key)


@pytest.mark.slow
def test_layouts_match_reference() -> None:
    cases = [
        (DENSE, P()),  # TP=1 (DP=2)
        (DENSE, P(tp=2)),
        (DENSE, P(tp=2, sp=True)),
        (DENSE, P(pp=2)),
        (TIED, P(pp=2)),
    ]
    run_world(2, _world, cases)
