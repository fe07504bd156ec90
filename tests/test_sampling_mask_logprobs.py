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
    return (
        torch.tensor([i for s in supports for i in s], dtype=torch.int32),
        torch.tensor([len(s) for s in supports], dtype=torch.int32),
    )


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
        vocab_parallel_topk_stats(
            hidden, weight, y, torch.zeros(n, 2, dtype=torch.long), 1.0, 3, False, None, ids, counts
        )


def test_seq_major_masks_reorders_segments() -> None:
    counts = torch.tensor([[1, 0, 2], [3, 1, 0]])
    ids = torch.tensor([10, 20, 21, 30, 31, 32, 40])  # row-major: (0,0) (0,2)x2 (1,0)x3 (1,1)
    new_ids, new_counts = seq_major_masks(ids, counts)
    # seq-major order: (0,0) (1,0) (0,1) (1,1) (0,2) (1,2)
    assert new_counts.tolist() == [1, 3, 0, 1, 2, 0]
    assert new_ids.tolist() == [10, 30, 31, 32, 40, 20, 21]


# --------------------------------------------------------------------------------------------
# engine (processed log-probs) vs megatron-core at TP=1 and TP=2 (one 2-rank gloo world)
# --------------------------------------------------------------------------------------------

TEMPERATURE = 0.8


def _engine_samples(mc):
    """Weights of a reference model; samples the embedded engine drew with top-p/top-k masks."""
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams
    from mcore_rl.runtime.rollout_manager import flat_masks

    torch.manual_seed(1234)
    hf = hf_config_from_model_config(mc)
    hf.initializer_range = 0.2  # peaked, input-dependent distributions: top-p supports of a few to many ids
    model = McoreRLForCausalLM(hf).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = EngineCore(model, load_tokenizer(None), context_length=64, logprobs_mode="processed")
    g = torch.Generator().manual_seed(3)
    params = [dict(top_p=0.9), dict(top_k=3), dict(top_p=0.2, top_k=50), dict(top_p=0.95, min_p=0.01), dict(top_k=1)]
    prompts = [torch.randint(0, mc.vocab_size, (3 + i,), generator=g).tolist() for i in range(8)]
    for i, prompt in enumerate(prompts):
        engine.add_request(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, ignore_eos=True, seed=i, **params[i % 5]),
                return_logprob=True,
                return_sampling_mask=True,
            )
        )
    outs = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                outs[o.rid] = o
    samples = []
    for i, prompt in enumerate(prompts):
        o = outs[f"r{i}"]
        assert [lp for lp, _ in o.output_token_logprobs] == o.output_token_sampling_logprobs  # processed mode
        ids, counts = flat_masks(o.output_token_sampling_mask)
        samples.append(
            Sample(
                Prompt(i, "", prompt),
                i,
                list(o.output_ids),
                list(o.output_token_sampling_logprobs),
                0,
                "length",
                sampling_mask_ids=ids,
                sampling_mask_counts=counts,
            )
        )
    sizes = [c for s in samples for c in s.sampling_mask_counts]
    assert min(sizes) < 5 and max(sizes) > 20, sizes  # small and large supports both
    return state, samples


def _check_layout(mc, pc, state, samples) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.models.shards import load_full_state_dict
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.forward_backward import prepare_config, wrap_ddp
    from mcore_rl.train.logprobs import compute_token_stats
    from mcore_rl.train.packing import build_microbatches

    layout = init_model_parallel(pc)
    set_seed(1)
    config = transformer_config(mc, pc)
    chunks = build_model(mc, pc, config=config)
    load_full_state_dict(chunks, hf_to_megatron(state, mc))
    chunks = wrap_ddp(chunks, config)
    prepare_config(config, chunks)
    t = max(len(s.response_ids) for s in samples)
    keys = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids", "label_mask_ids", "label_mask_counts")
    results = {}
    for masked in (True, False):
        mbs = build_microbatches(
            samples, range(len(samples)), 32, 2, ps.get_data_parallel_rank(), layout.dp, 0, t, sampling_masks=masked
        )
        stats = compute_token_stats(
            chunks,
            [{k: v for k, v in mb.items() if k in keys} for mb in mbs],
            temperature=TEMPERATURE,
            chunk_size=5,
            with_entropy=True,
        )
        got = {}
        for mb, st in zip(mbs, stats):
            for row, i in enumerate(mb["seq_index"].tolist()):
                k = len(samples[i].response_ids)
                got[i] = (
                    st.logprobs.reshape(-1)[mb["seq_pos"][row, :k]],
                    st.entropy.reshape(-1)[mb["seq_pos"][row, :k]],
                )
        results[masked] = got
    assert results[True], pc
    for i, (lp, ent) in results[True].items():
        mu = torch.tensor(samples[i].rollout_logp, dtype=torch.float32)
        torch.testing.assert_close(lp, mu, rtol=0, atol=1e-5, msg=lambda m: f"{pc} sample {i}: {m}")
        full_lp, full_ent = results[False][i]
        counts = torch.tensor(samples[i].sampling_mask_counts)
        assert bool((lp >= full_lp - 1e-6).all()) and bool((ent <= full_ent + 1e-5).all())
        single = counts == 1  # a singleton support: log-prob 0, entropy 0
        assert bool((lp[single].abs() < 1e-6).all()) and bool((ent[single].abs() < 1e-5).all())
        assert bool(((lp - full_lp)[counts > 1].abs() > 1e-4).any()) or not bool((counts > 1).any())
    ps.destroy_model_parallel()


def _mask_world(rank: int, world_size: int) -> None:
    from tests.helpers import DENSE, P

    state, samples = _engine_samples(DENSE)
    for pc in (P(), P(tp=2), P(tp=2, sp=True), P(pp=2)):
        _check_layout(DENSE, pc, state, samples)


@pytest.mark.slow
def test_trainer_masked_logprobs_match_engine_processed_tp1_tp2() -> None:
    """TP=1 (DP=2), TP=2, TP=2 with sequence parallelism, PP=2."""
    run_world(2, _mask_world)


# --------------------------------------------------------------------------------------------
# end to end: rollouts with masks, the learner renormalises π_old / π_ref / π_θ over them
# --------------------------------------------------------------------------------------------


def _e2e_mask(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.runtime.loop import RLRun
    from tests.helpers import tiny

    # fp32 engine with the trainer's weights: μ (processed) and the masked π_old are the same function
    cfg = tiny(
        f"run_dir={tmp}/m",
        "rollout.quantization=none",
        "rollout.sampling_mask_replay=true",
        "rollout.top_p=0.8",
        "rollout.top_k=30",
        "train.num_steps=1",
        "algorithm.kl_coef=0.05",
        "algorithm.entropy_coef=0.01",
        "eval.interval=0",
        "eval.at_start=false",
    )
    run = RLRun(cfg)
    try:
        run.initialise()
        samples, _ = run.rollouts()
        for s in samples:
            assert len(s.sampling_mask_counts) == len(s.response_ids) > 0
            assert sum(s.sampling_mask_counts) == len(s.sampling_mask_ids) and max(s.sampling_mask_counts) <= 30
            at = 0
            for tok, c in zip(s.response_ids, s.sampling_mask_counts):
                assert tok in s.sampling_mask_ids[at : at + c]
                at += c
        from mcore_rl.train.rl_step import Learner

        assert run.ref_chunks is not None  # π_ref is renormalised too (kl_coef > 0)
        learner = Learner(cfg, run.chunks, run.optimizer, run.ref_chunks, run.tokenizer.pad_id)
        records, metrics = learner.train(samples, 1)
    finally:
        run.close()
    assert metrics["mismatch/abs_logp_diff"] < 1e-5, metrics["mismatch/abs_logp_diff"]
    assert 1 <= metrics["rollout/sampling_mask_size_mean"] <= metrics["rollout/sampling_mask_size_max"] <= 30
    assert all(r.get("train/skipped", 0.0) == 0.0 for r in records) and all(
        torch.isfinite(torch.tensor(v)) for r in records for v in r.values()
    )


def test_end_to_end_sampling_mask_replay(tmp_path) -> None:
    run_world(1, _e2e_mask, str(tmp_path))
