"""The pure-torch reference Qwen3 / Qwen3-MoE against stock transformers, itself and megatron-core."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf import (
    McoreRLConfig,
    McoreRLForCausalLM,
    from_stock_state_dict,
    hf_config_from_model_config,
    model_config_from_hf_config,
    route,
    to_stock_hf_config,
    to_stock_state_dict,
)

VOCAB = 100


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: a CPU thread pool only adds contention (tens of ms per op on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(**kw) -> McoreRLConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # != hidden/heads, as in real Qwen3 checkpoints
        rope_theta=10000.0,
    )
    base.update(kw)
    return McoreRLConfig(**base)


def moe_config(**kw) -> McoreRLConfig:
    return tiny_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, **kw)


def make_model(cfg: McoreRLConfig, seed: int = 0) -> McoreRLForCausalLM:
    """Model with non-trivial norms and a router sharp enough for routing modes to differ."""
    torch.manual_seed(seed)
    model = McoreRLForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def ids(b: int = 2, s: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# ---- parity with stock transformers --------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_dense_matches_stock_qwen3(tie: bool) -> None:
    from transformers import Qwen3ForCausalLM

    cfg = tiny_config(tie_word_embeddings=tie)
    ref = make_model(cfg)
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == tie
    stock = Qwen3ForCausalLM(to_stock_hf_config(cfg)).eval()
    assert set(stock.state_dict()) == set(ref.state_dict())  # identical parameter names
    stock.load_state_dict(ref.state_dict(), strict=True)
    x = ids()
    with torch.no_grad():
        ours, theirs = ref(x), stock(x, labels=x)
        torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=0)
        # Megatron-style labels: labels[t] is the target of position t, so shift ourselves.
        labels = torch.roll(x, -1, dims=1)
        mask = torch.ones_like(x)
        mask[:, -1] = 0
        loss = ref(x, labels=labels, loss_mask=mask).loss
        torch.testing.assert_close(loss, theirs.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_matches_stock_qwen3_moe(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeForCausalLM

    cfg = moe_config(norm_topk_prob=norm_topk_prob)
    ref = make_model(cfg)
    sd = ref.state_dict()
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in sd and "model.layers.0.mlp.gate.weight" in sd
    stock = Qwen3MoeForCausalLM(to_stock_hf_config(cfg)).eval()
    stock_sd = to_stock_state_dict(sd, cfg)
    assert set(stock_sd) == set(stock.state_dict())
    stock.load_state_dict(stock_sd, strict=True)
    back = from_stock_state_dict(stock.state_dict(), cfg)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, stock(x).logits, atol=1e-5, rtol=0)
        # The routing mode must matter on this example, or the test would not tell them apart.
        other = make_model(moe_config(norm_topk_prob=not norm_topk_prob))
        assert (other(x).logits - ref(x).logits).abs().max() > 1e-4


def test_checkpoint_files_load_into_stock_and_auto_classes(tmp_path) -> None:
    """Our safetensors names are the HF Qwen3-MoE checkpoint names; save/from_pretrained round-trips."""
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    cfg = moe_config()
    ref = make_model(cfg)
    ref.save_pretrained(tmp_path / "ours")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert isinstance(again, McoreRLForCausalLM)
    ref.save_pretrained(tmp_path / "stock")
    to_stock_hf_config(cfg).save_pretrained(tmp_path / "stock")  # overwrite config.json
    assert json.loads((tmp_path / "stock" / "config.json").read_text())["model_type"] == "qwen3_moe"
    stock = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "stock").eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ref(x).logits, atol=0, rtol=0)
        torch.testing.assert_close(stock(x).logits, ref(x).logits, atol=1e-5, rtol=0)


def test_routing_matches_megatron_topk_router() -> None:
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    logits = torch.randn(11, 6, generator=torch.Generator().manual_seed(0))
    for norm_topk_prob in (True, False):
        probs, idx = route(logits, 3, norm_topk_prob)
        dense = torch.zeros_like(logits).scatter(1, idx, probs)
        mc_probs, mc_map = moe_utils.topk_routing_with_score_function(
            logits, 3, use_pre_softmax=not norm_topk_prob, score_function="softmax"
        )
        torch.testing.assert_close(dense, mc_probs, atol=1e-6, rtol=0)
        assert torch.equal(dense > 0, mc_map)


def test_shared_expert_is_added_ungated() -> None:
    cfg = moe_config(shared_expert_intermediate_size=16)
    with pytest.raises(ValueError):
        to_stock_hf_config(cfg)
    block = make_model(cfg).model.layers[0].mlp
    assert block.shared_expert is not None
    x = torch.randn(2, 5, cfg.hidden_size)
    with torch.no_grad():
        full, _ = block(x)
        shared, block.shared_expert = block.shared_expert, None
        routed, _ = block(x)
        torch.testing.assert_close(full, routed + shared(x), atol=1e-6, rtol=0)


# ---- KV cache and packed sequences -----------------------------------------------------------------


@pytest.mark.parametrize("cfg", [tiny_config(), moe_config()], ids=["dense", "moe"])
def test_kv_cache_decode_equals_full_forward(cfg: McoreRLConfig) -> None:
    model = make_model(cfg)
    x = ids(b=2, s=8)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :3], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(3, x.shape[1]):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    assert isinstance(cache, DynamicCache)  # a transformers Cache, as `generate` expects
    assert len(cache) == cfg.num_hidden_layers and cache.layers[0].keys.shape == (2, cfg.num_key_value_heads, 8, 16)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cfg", [tiny_config(), moe_config()], ids=["dense", "moe"])
def test_packed_documents_equal_separate_runs(cfg: McoreRLConfig) -> None:
    model = make_model(cfg)
    a, b = ids(b=1, s=4, seed=2), ids(b=1, s=5, seed=3)
    packed = torch.cat((a, b), dim=1)
    doc = torch.tensor([0] * 4 + [1] * 5)
    mask = (doc[:, None] == doc[None, :])[None, None]  # block-diagonal; causality is added inside
    pos = torch.cat((torch.arange(4), torch.arange(5)))[None]
    with torch.no_grad():
        together = model(packed, position_ids=pos, attention_mask=mask).logits
        separate = torch.cat((model(a).logits, model(b).logits), dim=1)
    torch.testing.assert_close(together, separate, atol=1e-5, rtol=0)


def test_left_padding_mask_matches_unpadded() -> None:
    model = make_model(tiny_config())
    x = ids(b=1, s=6)
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), x), dim=1)
    attn = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(padded, position_ids=pos, attention_mask=attn).logits
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[:, 3:], model(x).logits, atol=1e-5, rtol=0)


# ---- load-balancing aux loss -----------------------------------------------------------------------


def _aux_by_hand(router_logits: list[torch.Tensor], topk: int, coef: float) -> torch.Tensor:
    """coef * E * sum_i f_i * P_i per layer, summed over layers, with plain loops."""
    total = torch.zeros((), dtype=torch.float64)
    for logits in router_logits:
        p = torch.softmax(logits.double(), dim=-1)
        num_tokens, num_experts = p.shape
        counts = [0] * num_experts
        for t in range(num_tokens):
            for e in sorted(range(num_experts), key=lambda e: -p[t, e].item())[:topk]:
                counts[e] += 1
        for e in range(num_experts):
            f = counts[e] / (topk * num_tokens)
            prob_mean = p[:, e].sum() / num_tokens
            total = total + coef * num_experts * f * prob_mean
    return total


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_aux_loss_value(norm_topk_prob: bool) -> None:
    cfg = moe_config(router_aux_loss_coef=0.1, norm_topk_prob=norm_topk_prob)
    model = make_model(cfg).train()
    captured: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    out = model(ids(b=2, s=7))
    assert len(captured) == 2 and captured[0].shape == (14, 4)
    expected = _aux_by_hand(captured, topk=2, coef=0.1)
    torch.testing.assert_close(out.aux_loss.double(), expected, atol=1e-7, rtol=1e-6)
    out.aux_loss.backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0

    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    mc = torch.zeros(())
    for logits in captured:
        routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
        mc = mc + moe_utils.switch_load_balancing_loss_func(scores, routing_map.sum(0), logits.shape[0], 2, 4, 0.1)
    torch.testing.assert_close(out.aux_loss.detach(), mc, atol=1e-7, rtol=1e-6)


def test_aux_loss_zero_coef_has_no_gradient() -> None:
    model = make_model(moe_config(router_aux_loss_coef=0.0)).train()
    x = ids(b=2, s=7)
    labels = torch.roll(x, -1, dims=1)
    out = model(x, labels=labels)
    assert out.aux_loss.item() == 0.0 and not out.aux_loss.requires_grad
    (out.loss + out.aux_loss).backward()
    with_aux = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x, labels=labels).loss.backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(with_aux, model.parameters()))
    assert make_model(tiny_config())(x).aux_loss.item() == 0.0  # dense: zero too


# ---- config conversions -----------------------------------------------------------------------------


def test_model_config_round_trip() -> None:
    mc = ModelConfig.of(
        arch="qwen3_moe",
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_hidden_size=64,
        kv_channels=16,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=16,
        moe_aux_loss_coeff=0.01,
        moe_norm_topk_prob=False,
        tie_word_embeddings=True,
        rotary_base=1e6,
    )
    hf = hf_config_from_model_config(mc)
    assert (hf.num_experts, hf.moe_intermediate_size, hf.head_dim, hf.rope_theta) == (4, 24, 16, 1e6)
    assert model_config_from_hf_config(hf) == mc
    dense = ModelConfig(vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=64, rotary_base=5e5)
    assert model_config_from_hf_config(hf_config_from_model_config(dense)) == dense
    stock = to_stock_hf_config(hf_config_from_model_config(dense))
    assert type(stock).__name__ == "Qwen3Config"
    assert model_config_from_hf_config(stock) == dense
