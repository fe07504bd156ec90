"""Vocabulary padding (models/vocab_padding.py): a vocabulary not divisible by TP trains, and the
padded ids are invisible — to the log-probs, entropy and gradients, the SFT loss, the top-k of
distillation, the export and the weight sync — against the unpadded reference model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.vocab_padding import VOCAB_TENSORS, pad_vocab_rows, padded_columns_from, padded_vocab_size
from mcore_rl.train.logprobs import vocab_parallel_topk_stats
from tests.helpers import CHUNK, TEMPERATURE, _batches, _inputs, _loss, _naive
from tests.helpers import _logprob_reference
from tests.helpers import P
from tests.world import run_world

SMALL = ModelConfig(arch="qwen3", num_layers=2, hidden_size=64, ffn_hidden_size=128)
# (model, padded size at TP=2): 61 tokens (odd, so refused before at TP=2) padded to 64 x 2 = 128:
# rank 0 holds 61 real rows and 3 padded ones, rank 1's shard is only padding; at TP=1 it is 64 rows
CASES = [(dataclasses.replace(SMALL, vocab_size=61, make_vocab_size_divisible_by=64), 128)]


def test_padded_sizes_and_rows() -> None:
    assert padded_vocab_size(211, 1, 2) == 212 and padded_vocab_size(211, 128, 2) == 256
    assert padded_vocab_size(256, 128, 2) == 256 and padded_vocab_size(151_665, 128, 8) == 152_576
    w = torch.randn(5, 3)
    padded = pad_vocab_rows("output_layer.weight", w, 8)
    assert padded.shape == (8, 3) and torch.equal(padded[:5], w) and not padded[5:].any()
    assert pad_vocab_rows("decoder.final_layernorm.weight", w, 8) is w
    assert [padded_columns_from(50, start, 64) for start in (0, 64)] == [50, 0]
    assert padded_columns_from(None, 64, 64) == 64


@pytest.mark.parametrize("true_vocab", [11, 8])  # 8: the second "rank" shard of 4 is all padding
def test_padded_columns_are_not_scored(true_vocab: int) -> None:
    """Single shard: a weight with large random padded rows gives the unpadded model's log-probs,
    entropy and top-k log-probs, and no gradient reaches the padded rows."""
    hidden, weight, y = _inputs(vocab=true_vocab, dtype=torch.float32)
    y = y.clamp_max(true_vocab - 1)
    pad = torch.full((16 - true_vocab, weight.shape[1]), 5.0).requires_grad_()  # would dominate the softmax
    topk = torch.randint(0, true_vocab, (hidden.shape[0], 3))
    lp, ent, tk = vocab_parallel_topk_stats(
        hidden, torch.cat([weight, pad]), y, topk, TEMPERATURE, chunk_size=4, vocab_size=true_vocab
    )
    want_lp, want_ent = _naive(hidden, weight, y, TEMPERATURE)
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=1e-6)
    want_tk = ((hidden @ weight.t()) / TEMPERATURE).log_softmax(-1).gather(1, topk)
    torch.testing.assert_close(tk, want_tk, atol=1e-6, rtol=1e-6)
    (lp.sum() + ent.sum() + tk.sum()).backward()
    assert pad.grad is not None and not pad.grad.any()
    assert torch.isfinite(weight.grad).all() and torch.isfinite(hidden.grad).all()


def _check(mc: ModelConfig, padded: int) -> list:
    """Every check in TP=2; returns the model chunks (weights as loaded, padded rows overwritten)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.hf.weight_map import full_megatron_to_hf, hf_to_megatron
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.models.shards import gather_full_state_dict, iter_local_params, load_full_state_dict
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp
    from mcore_rl.train.logprobs import _decoder_output_only, output_weight, tp_region, unwrap_gpt
    from mcore_rl.train.logprobs import make_forward_step
    from mcore_rl.train.teachers import vocab_parallel_topk
    from mcore_rl.train.weight_sync import iter_hf_weights

    name = f"vocab {mc.vocab_size} -> {padded}"
    batches = _batches(mc.vocab_size)
    ref_obj, ref_stats, ref_state, ref_grads = _logprob_reference(mc, batches)
    pc = P(tp=2)
    config = transformer_config(mc, pc)
    chunks = build_model(mc, pc, config=config)
    load_full_state_dict(chunks, hf_to_megatron(ref_state, mc))  # import: true-size tables padded
    gpt = unwrap_gpt(chunks[0])
    rank = ps.get_tensor_model_parallel_rank()
    local = padded // 2
    assert gpt.vocab_size == padded and output_weight(gpt).shape[0] == local, name
    with torch.no_grad():  # padded rows that would dominate every softmax if they were read
        for _, global_name, param in iter_local_params(chunks):
            if global_name in VOCAB_TENSORS:
                start = padded_columns_from(mc.vocab_size, rank * local, local)
                param[start:] = 3.0

    # export and weight sync: exactly the reference's (unpadded) tables
    expected = {k: v for k, v in ref_state.items() if not (mc.tie_word_embeddings and k == "lm_head.weight")}
    exported = full_megatron_to_hf(gather_full_state_dict(chunks), mc)
    assert set(exported) == set(expected), name
    for key, want in expected.items():
        assert torch.equal(exported[key], want), f"{name}: export {key}"
    synced = dict(iter_hf_weights(chunks, mc))
    if torch.distributed.get_rank() == 0:
        assert set(synced) == set(expected), name
        for key, want in expected.items():
            assert torch.equal(synced[key], want), f"{name}: sync {key}"

    # SFT loss (megatron's own cross entropy over the output layer's logits): the padded columns are -inf
    tokens, labels = batches[0]["tokens"], batches[0]["labels"]
    with torch.no_grad():
        losses = gpt(tokens, batches[0]["position_ids"], None, labels=labels)
    torch.testing.assert_close(
        -losses, _ref_logp(ref_state, mc, batches[0]), atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} sft loss {m}"
    )

    # distillation top-k: never a padded id; the reference's ids and log-probs
    with torch.no_grad(), _decoder_output_only(gpt):
        hidden = tp_region(gpt(tokens, batches[0]["position_ids"], None), False)
    s, b, h = hidden.shape
    k = min(mc.vocab_size, 60)
    vals, ids = vocab_parallel_topk(
        hidden.reshape(s * b, h),
        output_weight(gpt),
        k,
        TEMPERATURE,
        CHUNK,
        ps.get_tensor_model_parallel_group(),
        mc.vocab_size,
    )
    assert int(ids.max()) < mc.vocab_size, name
    want = (_ref_logits(ref_state, mc, batches[0]) / TEMPERATURE).log_softmax(-1).transpose(0, 1).reshape(s * b, -1)
    torch.testing.assert_close(
        vals, want.topk(k, dim=-1).values, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} top-k {m}"
    )

    # log-probs, entropy and gradients through the training step, against the unpadded reference
    chunks = wrap_ddp(chunks, config)
    prepare_config(config, chunks)
    store: list = []
    result = forward_backward(
        chunks, batches, forward_step=make_forward_step(_loss, temperature=TEMPERATURE, chunk_size=CHUNK, store=store)
    )
    assert abs(result["loss"] - ref_obj) <= 1e-5 * abs(ref_obj) + 1e-7, f"{name}: {result['loss']} vs {ref_obj}"
    for report, (want_lp, want_ent) in zip(store, ref_stats):
        torch.testing.assert_close(report["logprobs"], want_lp, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} lp {m}")
        torch.testing.assert_close(report["entropy"], want_ent, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} ent {m}")
    grads = gather_full_state_dict(chunks, grads=True)
    for key, want in hf_to_megatron(ref_grads, mc).items():
        got = grads[key]
        if key in VOCAB_TENSORS:  # no gradient in the padded rows
            assert not got[mc.vocab_size :].any(), f"{name}: gradient in padded rows of {key}"
            got = got[: mc.vocab_size]
        scale = float(want.abs().max()) or 1.0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale, msg=lambda m: f"{name} grad {key}: {m}")
    return chunks


def _ref_logits(state: dict, mc: ModelConfig, batch: dict) -> torch.Tensor:
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    model = McoreRLForCausalLM(hf_config_from_model_config(mc))
    model.load_state_dict(state)
    with torch.no_grad():
        return model(batch["tokens"], position_ids=batch["position_ids"]).logits.float()


def _ref_logp(state: dict, mc: ModelConfig, batch: dict) -> torch.Tensor:
    """log p(label) [b, s] at temperature 1 (megatron's per-token losses are -this)."""
    lp = _ref_logits(state, mc, batch).log_softmax(-1)
    return lp.gather(-1, batch["labels"][..., None]).squeeze(-1)


def _world(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.hf.weight_map import full_megatron_to_hf
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train import checkpoint

    init_model_parallel(P(tp=2))
    for mc, padded in CASES:
        set_seed(1)
        chunks = _check(mc, padded)
    # the padded size depends on TP (here 128 rows at TP=2, 64 at TP=1): a checkpoint saved in one
    # layout loads into the other (megatron-core loads vocabulary tables with allow_shape_mismatch)
    want = full_megatron_to_hf(gather_full_state_dict(chunks), mc)
    checkpoint.save_checkpoint(tmp, 0, chunks, None, {})
    init_model_parallel(P())
    set_seed(1)
    tp1 = build_model(mc, P())
    assert tp1[0].vocab_size == padded_vocab_size(mc.vocab_size, mc.make_vocab_size_divisible_by, 1) == 64
    checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp), tp1, None)
    got = full_megatron_to_hf(gather_full_state_dict(tp1), mc)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_tp2_with_padding_matches_unpadded_reference(tmp_path) -> None:
    run_world(2, _world, str(tmp_path / "ckpt"))
