"""Qwen2 / Qwen2.5 (q/k/v biases), Qwen2-MoE (gated shared expert) and Mistral (sliding window).

Tiny stock checkpoints made here (random weights, `save_pretrained`): the reference model computes
what the stock `transformers` class computes for the same weights; the embedded engine (KV cache,
decode past the window) generates what stock `generate` does; HF -> megatron -> HF round-trips
bit for bit to the stock class; the megatron model's logits in TP=2, PP=2 (and EP=2) equal the
stock model's, and the weight sync gathers the new tensors (QKV biases, the shared expert gate)
back to their HF names in each layout. One spawned world holds every megatron check.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig
from tests.helpers import (
    CONVERT_SEQ as SEQ,
    VOCAB,
    _assert_same_checkpoint,
    _load_tensors,
    _megatron_logits,
    _randomize,
    _tokens,
)

WINDOW = 6  # < SEQ, so the window changes the logits


def _stock_config(kind: str, vocab: int = VOCAB, **overrides):
    from transformers import MistralConfig, Qwen2Config, Qwen2MoeConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "mistral":
        return MistralConfig(**{"head_dim": 16, "sliding_window": WINDOW, **common})
    return Qwen2MoeConfig(
        **{
            **dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                router_aux_loss_coef=0.01,
            ),
            **common,
        }
    )


def _stock_model(kind: str, vocab: int = VOCAB, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_stock_config(kind, vocab, **overrides)).eval()
    _randomize(model)  # biases and the gate are 1-D / [1, h]: both get non-trivial values
    return model


def _reference_of(stock):
    from mcore_rl.convert import model_config_from_hf
    from mcore_rl.hf import McoreRLForCausalLM, from_stock_state_dict, hf_config_from_model_config

    cfg = hf_config_from_model_config(model_config_from_hf(stock.config))
    ref = McoreRLForCausalLM(cfg).eval()
    ref.load_state_dict(from_stock_state_dict(stock.state_dict(), cfg), strict=True)
    return ref


# ---------------------------------------------------------------------------------------------
# configs, export kinds, refusals, FLOPs (no megatron)
# ---------------------------------------------------------------------------------------------


def test_model_configs_and_export_kinds() -> None:
    from mcore_rl.convert import export_kind, model_config_from_hf

    qwen2, moe, mistral = (model_config_from_hf(_stock_config(k)) for k in ("qwen2", "qwen2_moe", "mistral"))
    assert (qwen2.add_qkv_bias, qwen2.qk_layernorm, qwen2.sliding_window) == (True, False, None)
    assert qwen2.kv_channels is None
    assert (
        moe.arch,
        moe.add_qkv_bias,
        moe.section(MoEKeys).moe_shared_expert_gate,
        moe.section(MoEKeys).moe_shared_expert_intermediate_size,
    ) == (
        "qwen3_moe",
        True,
        True,
        48,
    )
    assert (
        moe.section(MoEKeys).moe_norm_topk_prob is False
    )  # the stock default: softmax over all experts, keep the top k
    assert (mistral.add_qkv_bias, mistral.qk_layernorm, mistral.sliding_window) == (False, False, WINDOW)
    assert not model_config_from_hf(_stock_config("qwen2_moe", qkv_bias=False)).add_qkv_bias
    assert [export_kind(m) for m in (qwen2, moe, mistral)] == ["qwen2", "qwen2_moe", "mistral"]
    # Mistral without a window is Llama: the source's model_type picks the class.
    no_window = model_config_from_hf(_stock_config("mistral", sliding_window=None))
    assert no_window.sliding_window is None
    assert (export_kind(no_window), export_kind(no_window, "mistral")) == ("llama", "mistral")
    # No stock class has these: our remote-code model does.
    assert export_kind(dataclasses.replace(qwen2, qk_layernorm=True)) == "remote"  # Qwen3 + q/k/v biases
    assert export_kind(dataclasses.replace(qwen2, sliding_window=8)) == "remote"  # Qwen2's window is per layer
    assert export_kind(moe.replace(moe_shared_expert_gate=False)) == "remote"  # ungated, no QK-norm


def test_refusals_name_the_key() -> None:
    from mcore_rl.config import ConfigError, SFTConfig, validate_sft_config
    from mcore_rl.convert import model_config_from_hf

    with pytest.raises(ValueError, match="use_sliding_window=true"):
        model_config_from_hf(_stock_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1))
    # Mixed dense/MoE Qwen2-MoE layers map to model.moe_layer_pattern, and back to the source's own keys
    from mcore_rl.hf import hf_config_from_model_config, to_stock_hf_config

    for extra, pattern in [({"mlp_only_layers": [0]}, [0, 1]), ({"decoder_sparse_step": 2}, [0, 1])]:
        stock = _stock_config("qwen2_moe", **extra)
        mc = model_config_from_hf(stock)
        assert mc.section(MoEKeys).moe_layer_pattern == pattern[: stock.num_hidden_layers] + [1] * (
            stock.num_hidden_layers - 2
        )
        back = to_stock_hf_config(hf_config_from_model_config(mc), "qwen2_moe")
        assert (
            type(back).__name__ == "Qwen2MoeConfig"
            and model_config_from_hf(back).section(MoEKeys).moe_layer_pattern == mc.section(MoEKeys).moe_layer_pattern
        )
    dense = ModelConfig(vocab_size=VOCAB)
    for model, key in [
        (dense.replace(moe_shared_expert_gate=True), "model.moe_shared_expert_gate"),
        (dataclasses.replace(dense, sliding_window=0), "model.sliding_window"),
    ]:
        with pytest.raises(ConfigError, match=key):
            validate_sft_config(SFTConfig(model=model), 1)


def test_flops_count_the_gate_and_the_window() -> None:
    from mcore_rl.convert import model_config_from_hf
    from mcore_rl.models.flops import forward_flops_per_token

    moe = model_config_from_hf(_stock_config("qwen2_moe"))
    ungated = moe.replace(moe_shared_expert_gate=False)
    gate = forward_flops_per_token(moe, 64).mlp - forward_flops_per_token(ungated, 64).mlp
    assert gate == 2.0 * moe.hidden_size * moe.num_layers
    mistral = model_config_from_hf(_stock_config("mistral"))
    full = dataclasses.replace(mistral, sliding_window=None)
    q_dim, s = mistral.num_attention_heads * mistral.head_dim, 64
    keys = sum(min(i + 1, WINDOW) for i in range(s)) / s  # query i reads min(i + 1, W) keys
    assert forward_flops_per_token(mistral, s).attention_scores == pytest.approx(mistral.num_layers * 4 * q_dim * keys)
    causal = mistral.num_layers * 4 * q_dim * (s + 1) / 2
    assert forward_flops_per_token(full, s).attention_scores == pytest.approx(causal)


# ---------------------------------------------------------------------------------------------
# reference model and embedded engine vs stock transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, overrides",
    [("qwen2", {}), ("qwen2_moe", {}), ("qwen2_moe", {"norm_topk_prob": True}), ("mistral", {})],
    ids=["qwen2", "qwen2_moe", "qwen2_moe_norm_topk", "mistral"],
)
def test_reference_matches_stock(kind: str, overrides: dict) -> None:
    stock = _stock_model(kind, **overrides)
    ref = _reference_of(stock)
    x = _tokens()
    with torch.no_grad():
        want = stock(x).logits
        torch.testing.assert_close(ref(x).logits, want, atol=1e-5, rtol=0)
        if kind == "mistral":  # the window matters at this length, and the reference applies it
            ref.config.sliding_window = None
            assert (ref(x).logits - want).abs().max() > 1e-2
        if kind == "qwen2_moe":  # so does the gate
            gate = ref.model.layers[0].mlp.shared_expert_gate
            gate.weight.mul_(-1)
            assert (ref(x).logits - want).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["mistral", "qwen2_moe"])
def test_engine_generates_as_stock(kind: str, tmp_path) -> None:
    """Served from the stock checkpoint: prefill + KV-cache decode (past the window for Mistral)
    give stock `generate`'s greedy tokens and the log-probs of a stock full forward."""
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams

    stock = _stock_model(kind, vocab=384)  # the bundled byte tokenizer's vocabulary
    stock.save_pretrained(tmp_path)
    engine = EngineCore.from_model_path(str(tmp_path), context_length=64)
    prompt = list(range(40, 48))  # 8 tokens; 10 more decode well past a window of 6
    engine.add_request(
        Request("r", prompt, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True), return_logprob=True)
    )
    out = None
    while engine.has_work():
        out = next((o for o in engine.step() if o.finished), out)
    with torch.no_grad():
        want = stock.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert out.output_ids == want
        ids = torch.tensor([prompt + want])
        lp = torch.log_softmax(stock(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor([p for p, _ in out.output_token_logprobs]), lp[len(prompt) - 1 :], atol=1e-4, rtol=0
    )


# ---------------------------------------------------------------------------------------------
# through megatron: round trips, logits in TP / PP / EP, weight sync (one world)
# ---------------------------------------------------------------------------------------------


def _packed_mask(tokens: torch.Tensor, split: int) -> torch.Tensor:
    """Megatron's mask for rows packing two documents [0, split) and [split, SEQ) (True = masked)."""
    from mcore_rl.train.forward_backward import attention_mask_from_segments

    segments = (torch.arange(SEQ) >= split).long().expand_as(tokens)
    return attention_mask_from_segments(segments)


def _world(rank: int, world_size: int, tmp: str, cases: list) -> None:
    import torch.distributed as dist

    from mcore_rl.convert import hf_to_mcore, mcore_to_hf, model_config_from_hf, read_hf_config

    for name, convert_layout, check_layouts in cases:
        src, mcore, export = f"{tmp}/{name}/hf", f"{tmp}/{name}/mcore", f"{tmp}/{name}/export"
        hf_to_mcore(src, mcore, convert_layout)
        mcore_to_hf(mcore, export)
        mc = model_config_from_hf(read_hf_config(src))
        tokens = _tokens(mc.vocab_size)
        for layout, pc in check_layouts.items():
            _megatron_logits(
                mc,
                pc,
                mcore,
                tokens,
                f"{tmp}/{name}/logits_{layout}.pt",
                hf_weights_out=f"{tmp}/{name}/synced_{layout}.pt",
            )
        if mc.sliding_window:  # packed documents keep their mask next to the window
            pc = check_layouts["tp2"]
            _megatron_logits(mc, pc, mcore, tokens, f"{tmp}/{name}/logits_packed.pt", _packed_mask(tokens, 7))
        dist.barrier()


@pytest.mark.slow
def test_round_trip_parity_and_sync_in_tp_pp_ep(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from mcore_rl.convert import parallel_config as P
    from tests.world import run_world

    stock_classes = {"qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mistral": "MistralForCausalLM"}
    dtypes = {"qwen2": torch.bfloat16, "qwen2_moe": torch.float32, "mistral": torch.float32}
    for kind in stock_classes:
        _stock_model(kind).to(dtypes[kind]).save_pretrained(tmp_path / kind / "hf")
    cases = [
        ("qwen2", P(tp=2), {"tp2": P(tp=2), "pp2": P(pp=2)}),
        ("qwen2_moe", P(ep=2), {"tp2": P(tp=2), "pp2": P(pp=2), "ep2": P(ep=2)}),  # TP=2 with SP
        ("mistral", P(pp=2), {"tp2": P(tp=2), "pp2": P(pp=2)}),
    ]
    run_world(2, _world, str(tmp_path), cases)
    for kind, _, layouts in cases:
        case = tmp_path / kind
        _assert_same_checkpoint(case / "hf", case / "export")  # bit for bit, same dtype, same config.json
        model = AutoModelForCausalLM.from_pretrained(case / "export", dtype=torch.float32).eval()
        assert type(model).__name__ == stock_classes[kind]
        source = _load_tensors(case / "hf")
        x = _tokens()
        with torch.no_grad():
            want = model(x).logits
        for layout in layouts:
            got = torch.load(case / f"logits_{layout}.pt")
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m, c=f"{kind} {layout}": f"{c}: {m}")
            synced = torch.load(case / f"synced_{layout}.pt")
            assert set(synced) == set(source), (kind, layout, sorted(set(synced) ^ set(source)))
            for name, tensor in source.items():
                assert torch.equal(synced[name].to(tensor.dtype), tensor), (kind, layout, name)
        if kind == "mistral":  # each packed document alone, through the stock model
            packed = torch.load(case / "logits_packed.pt")
            with torch.no_grad():
                alone = torch.cat([model(x[:, :7]).logits, model(x[:, 7:]).logits], dim=1)
            torch.testing.assert_close(packed, alone, atol=1e-4, rtol=0)
    qwen2 = _load_tensors(tmp_path / "qwen2" / "hf")
    moe = _load_tensors(tmp_path / "qwen2_moe" / "hf")
    assert "model.layers.1.self_attn.k_proj.bias" in qwen2 and "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert moe["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
