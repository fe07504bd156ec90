"""AttnRes (Full and Block): the reference model's properties, and megatron-core parity.

Fast tests check the reference (`mcore_rl/hf/attn_res.py`) against the properties the paper states (arXiv:2603.15031):
Block with N = L equals Full, Block with N = 1 and zero queries is the standard residual network,
depth weights are a convex combination that ignores the scale of a source, incremental decoding
with the KV cache equals the full forward. The slow test checks the megatron-core block against
the reference in TP/SP, PP, VPP, EP and full-recompute layouts (tests/test_parity.py harness).
"""

from __future__ import annotations


import pytest
import torch

from mcore_rl.config.model_keys.attn_res import AttnResKeys
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf import (
    McoreRLConfig,
    McoreRLForCausalLM,
    hf_config_from_model_config,
    model_config_from_hf_config,
    to_stock_hf_config,
)
from mcore_rl.hf.attn_res import AttnResMixer, block_index, block_starts, num_sources_after

VOCAB = 100


def tiny_config(**kw) -> McoreRLConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    base.update(kw)
    return McoreRLConfig(**base)


def make_model(cfg: McoreRLConfig, seed: int = 0, query_std: float = 0.5) -> McoreRLForCausalLM:
    """Random weights, non-trivial norms and (unless query_std=0) non-zero pseudo-queries."""
    torch.manual_seed(seed)
    model = McoreRLForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0.0, query_std) if query_std else p.zero_()
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def ids(b: int = 2, s: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# ---- block layout -----------------------------------------------------------------------------


def test_block_layout() -> None:
    # 8 sublayers in 3 blocks: S = 2, the last block takes the remainder
    assert [block_index(j, 8, 3) for j in range(8)] == [0, 0, 1, 1, 2, 2, 2, 2]
    assert block_starts(8, 3) == [True, False, True, False, True, False, False, False]
    assert block_starts(6, 6) == [True] * 6  # N = L: every sublayer is a block (Full)
    assert block_starts(6, 1) == [True] + [False] * 5
    for total in (2, 6, 8, 13):
        for n in range(1, total + 1):
            assert len({block_index(j, total, n) for j in range(total)}) == n  # exactly N blocks
    # sources after c sublayers: b_0, the finished blocks, the partial sum
    assert [num_sources_after(c, 8, 3) for c in range(1, 9)] == [2, 2, 3, 3, 4, 4, 4, 4]
    with pytest.raises(ValueError):
        block_index(0, 6, 7)
    with pytest.raises(ValueError):
        tiny_config(attn_res="block", attn_res_num_blocks=7)  # > 2 x 3 layers
    with pytest.raises(ValueError):
        tiny_config(attn_res="blocks")


# ---- reference properties (the paper's) -------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True])
def test_block_with_n_equal_l_is_full(moe: bool) -> None:
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24) if moe else {}
    full = make_model(tiny_config(attn_res="full", **extra))
    block = make_model(tiny_config(attn_res="block", attn_res_num_blocks=6, **extra))
    x, labels = ids(), ids(seed=2)
    out_full, out_block = full(x, labels=labels), block(x, labels=labels)
    torch.testing.assert_close(out_block.logits, out_full.logits, rtol=0, atol=0)
    (out_full.loss + out_full.aux_loss).backward()
    (out_block.loss + out_block.aux_loss).backward()
    grads_block = dict(block.named_parameters())
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads_block[name].grad, p.grad, rtol=1e-6, atol=1e-9, msg=name)
    # ... and a real Block variant differs
    other = make_model(tiny_config(attn_res="block", attn_res_num_blocks=2, **extra))
    assert (other(x).logits - out_full.logits).abs().max() > 1e-3


def test_block_n1_with_zero_queries_is_standard_residual() -> None:
    """N = 1, w = 0: uniform weights over [b_0, partial] = half the residual stream, which pre-norm
    sublayers and the final norm cannot tell apart (eps -> 0)."""
    plain = make_model(tiny_config(rms_norm_eps=1e-12))
    n1 = tiny_config(rms_norm_eps=1e-12, attn_res="block", attn_res_num_blocks=1)
    attn_res = make_model(n1, query_std=0)
    missing, unexpected = attn_res.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(".query" in k or "res.norm" in k for k in missing)
    x = ids()
    torch.testing.assert_close(attn_res(x).logits, plain(x).logits, rtol=1e-5, atol=1e-5)
    # with learned (non-zero) queries it is a different, convex mix
    with torch.no_grad():
        for name, p in attn_res.named_parameters():
            if name.endswith(".query"):
                p.normal_(0.0, 0.5)
    assert (attn_res(x).logits - plain(x).logits).abs().max() > 1e-3


def test_depth_weights() -> None:
    torch.manual_seed(0)
    mixer = AttnResMixer(16, eps=1e-12)
    with torch.no_grad():
        mixer.query.normal_()
        mixer.norm.weight.normal_(1.0, 0.2)
    sources = [torch.randn(3, 5, 16) * s for s in (0.1, 1.0, 10.0, 3.0)]
    alpha = mixer.weights(sources)
    assert alpha.shape == (4, 3, 5) and bool((alpha >= 0).all())
    torch.testing.assert_close(alpha.sum(0), torch.ones(3, 5))
    torch.testing.assert_close(mixer(sources), sum(a[..., None] * v for a, v in zip(alpha, sources)))
    # scaling a source by c > 0 leaves every weight unchanged (RMSNorm on the keys)
    scaled = [sources[0], sources[1] * 7.5, sources[2], sources[3] * 0.01]
    torch.testing.assert_close(mixer.weights(scaled), alpha, rtol=1e-5, atol=1e-6)
    # one source (the first sublayer: the embedding alone): the mix is that source
    torch.testing.assert_close(mixer(sources[:1]), sources[0])


def test_first_sublayer_sees_only_the_embedding() -> None:
    model = make_model(tiny_config(attn_res="block", attn_res_num_blocks=3))
    seen = []
    layer0 = model.model.layers[0]
    handle = layer0.input_layernorm.register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    x = ids()
    model(x)
    handle.remove()
    torch.testing.assert_close(seen[0], model.model.embed_tokens(x))


@pytest.mark.parametrize("variant,blocks", [("full", 8), ("block", 3)])
def test_kv_cache_decode_matches_full_forward(variant: str, blocks: int) -> None:
    model = make_model(tiny_config(attn_res=variant, attn_res_num_blocks=blocks))
    x = ids(b=2, s=9)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :5], use_cache=True)
        steps = [out.logits]
        cache = out.cache
        for t in range(5, 9):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert len(cache) == 3 and cache.get_seq_length() == 9  # the ordinary per-layer (k, v) cache


@pytest.mark.parametrize("variant", ["none", "full", "block"])
def test_depth_state_drives_any_layer_loop(variant: str) -> None:
    """`DepthState` is how a hand-written layer loop (the embedded engine's runner) supports every
    variant: driving the modules with it reproduces the model's own forward exactly."""
    from mcore_rl.hf.attn_res import DepthState
    from mcore_rl.hf.modeling import _allowed_mask, rope_cos_sin

    model = make_model(tiny_config(attn_res=variant, attn_res_num_blocks=4))
    x = ids()
    m = model.model
    with torch.no_grad():
        state = DepthState(m, m.embed_tokens(x))
        positions = torch.arange(x.shape[1])[None]
        cos, sin = rope_cos_sin(positions, m.config.head_dim, m.config.rope_theta, torch.float32)
        allowed = _allowed_mask(None, x.shape[1], 0, x.device)
        for i, layer in enumerate(m.layers):
            state.add(layer.self_attn(layer.input_layernorm(state.input(i, 0)), cos, sin, allowed)[0])
            state.add(layer.mlp(layer.post_attention_layernorm(state.input(i, 1))))
        logits = model.lm_head(m.norm(state.output()))
        torch.testing.assert_close(logits, model(x).logits, rtol=0, atol=0)


# ---- configs, checkpoints, weight names ------------------------------------------------------------


def test_configs_and_checkpoint_roundtrip(tmp_path) -> None:
    mc = ModelConfig.of(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        attn_res="block",
        attn_res_num_blocks=3,
    )
    hf = hf_config_from_model_config(mc)
    assert (hf.attn_res, hf.attn_res_num_blocks) == ("block", 3)
    back = model_config_from_hf_config(hf)
    assert (back.section(AttnResKeys).attn_res, back.section(AttnResKeys).attn_res_num_blocks) == ("block", 3)
    with pytest.raises(ValueError, match="AttnRes"):
        to_stock_hf_config(hf)
    fresh = McoreRLForCausalLM(hf)  # paper: pseudo-queries start at zero (uniform weights)
    queries = [p for n, p in fresh.named_parameters() if n.endswith(".query")]
    assert len(queries) == 2 * 2 + 1 and all(bool((q == 0).all()) for q in queries)
    model = make_model(hf)
    model.save_pretrained(tmp_path)
    loaded = McoreRLForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.attn_res == "block" and loaded.config.attn_res_num_blocks == 3
    x = ids()
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_weight_map_roundtrip() -> None:
    from mcore_rl.hf.weight_map import full_megatron_to_hf, hf_to_megatron

    mc = ModelConfig.of(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        attn_res="full",
    )
    state = make_model(hf_config_from_model_config(mc)).state_dict()
    meg = hf_to_megatron(state, mc)
    assert "decoder.final_res.query" in meg and "decoder.layers.1.mlp_res.norm.weight" in meg
    back = full_megatron_to_hf(meg, mc)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_validation() -> None:
    from mcore_rl.config import ConfigError, SFTConfig, load_config, validate_sft_config

    cfg = SFTConfig()
    cfg.model = cfg.model.replace(num_layers=2, attn_res="block", attn_res_num_blocks=5)
    with pytest.raises(ConfigError, match="model.attn_res_num_blocks"):
        validate_sft_config(cfg, 1)
    cfg.model = cfg.model.replace(attn_res_num_blocks=4)
    validate_sft_config(cfg, 1)
    with pytest.raises(ConfigError, match="model.attn_res"):
        load_config(SFTConfig, overrides=["model.attn_res=blocks"])


# ---- megatron side, no process group needed ---------------------------------------------------------


def test_megatron_mixer_matches_reference() -> None:
    """The stack-free mix of models/attn_res.py equals the literal one of hf/attn_res.py."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_rl.models.attn_res import AttnResMixer as MegatronMixer, inv_rms

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, layernorm_epsilon=1e-6, use_cpu_initialization=True
    )
    torch.manual_seed(0)
    ref = AttnResMixer(16, eps=1e-6)
    with torch.no_grad():
        ref.query.normal_()
        ref.norm.weight.normal_(1.0, 0.2)
    meg = MegatronMixer(config)
    meg.load_state_dict(ref.state_dict())
    sources = [(torch.randn(5, 3, 16) * s).requires_grad_() for s in (0.1, 1.0, 10.0)]
    got = meg(sources, [inv_rms(v, 1e-6) for v in sources])
    want = ref(sources)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    grads_got = torch.autograd.grad(got, sources + list(meg.parameters()), g)
    grads_want = torch.autograd.grad(want, sources + list(ref.parameters()), g)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_pipeline_message_grows_with_blocks_not_layers() -> None:
    from mcore_rl.models.attn_res import max_sources_at_boundaries

    for layers in (8, 32, 128):
        stages = [layers * k // 8 for k in range(8)]  # PP=8 boundaries
        assert max_sources_at_boundaries(stages, layers, num_blocks=8) <= 9  # <= N + 1
        full = max_sources_at_boundaries(stages, layers, num_blocks=2 * layers)
        assert full == 2 * (layers * 7 // 8) + 1  # Full: every sublayer output before the last stage
    assert max_sources_at_boundaries([0], 4, 3) == 1  # no pipeline: plain [s, b, h]
    assert max_sources_at_boundaries([0, 2], 4, 3) == 3  # b_0, b_1, partial b_2
    assert max_sources_at_boundaries([0, 1, 2, 3], 4, 3) == 4


# ---- megatron-core parity (2 gloo ranks, one world) ----------------------------------------------------

FULL = ModelConfig.of(arch="qwen3", num_layers=4, hidden_size=64, ffn_hidden_size=128, attn_res="full")
# 8 sublayers in 3 blocks (2, 2, 4): pipeline boundaries fall inside and between blocks
BLOCK = FULL.replace(attn_res="block", attn_res_num_blocks=3)
BLOCK_MOE = ModelConfig.of(
    arch="qwen3_moe",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    moe_aux_loss_coeff=0.01,
    attn_res="block",
    attn_res_num_blocks=3,
)


def _parity_world(rank: int, world_size: int, tmp: str) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.models import attn_res
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.parallel.setup import init_model_parallel
    from tests.helpers import P, _check_layout, _global_batch
    from tests.helpers import _parity_reference

    cases = [
        (FULL, P(tp=2, sp=True), "none"),
        (FULL, P(pp=2), "none"),  # 5 sources cross the boundary
        (BLOCK, P(tp=2), "none"),
        (BLOCK, P(pp=2, vpp=2), "none"),  # 3 boundaries, at most 4 sources
        (BLOCK, P(pp=2), "full"),  # full activation recompute under PP
        (BLOCK_MOE, P(ep=2), "none"),
    ]
    refs = {}
    for mc, pc, recompute in cases:
        key = repr(mc)
        if key not in refs:
            batches = _global_batch(mc.vocab_size)
            refs[key] = (batches, _parity_reference(mc, batches))
        batches, ref = refs[key]
        _check_layout(mc, pc, batches, ref, recompute=recompute)

    # the pipeline message size (slabs of [s, b, h]) each layout announces to the schedule
    slabs = [(FULL, P(pp=2), 5), (BLOCK, P(pp=2), 3), (BLOCK, P(pp=2, vpp=2), 4), (BLOCK, P(tp=2), 1)]
    for mc, pc, want in slabs:
        init_model_parallel(pc)
        chunks = build_model(mc, pc, config=transformer_config(mc, pc))
        assert all(isinstance(c.decoder, attn_res.AttnResTransformerBlock) for c in chunks)
        assert {c.decoder.p2p_seq_factor for c in chunks} == {want}, (mc.section(AttnResKeys).attn_res, pc)
        names = {n for c in chunks for n, _ in c.named_parameters()}
        last = ps.is_pipeline_last_stage()
        assert ("decoder.final_res.query" in names) == last

    _sft_checkpoint_reshard(tmp)


def _sft_checkpoint_reshard(tmp: str) -> None:
    """`mcore-rl sft` trains an AttnRes model under PP=2 and its checkpoint loads into TP=2+SP."""
    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.train import sft

    def cfg(run: str, parallel: list[str], **checkpoint: str) -> SFTConfig:
        overrides = [
            f"run_dir={tmp}/{run}",
            "train.train_iters=3",
            "train.log_interval=100",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "train.seq_length=32",
            "data.synthetic_num_examples=256",
            "model.num_layers=4",
            "model.attn_res=block",
            "model.attn_res_num_blocks=3",
        ]
        overrides += [f"parallel.{p}" for p in parallel]
        overrides += [f"checkpoint.{k}={v}" for k, v in checkpoint.items()]
        return load_config(SFTConfig, None, overrides)

    pp2 = ["pipeline_model_parallel_size=2"]
    losses = [r["loss"] for r in sft.run_sft(cfg("a", pp2, save_dir=f"{tmp}/ckpt"))]
    assert losses[-1] < losses[0], losses
    saved = gather_full_state_dict(sft.build_trainer(cfg("b", pp2, load_dir=f"{tmp}/ckpt")).chunks)
    resharded = gather_full_state_dict(
        sft.build_trainer(
            cfg("c", ["tensor_model_parallel_size=2", "sequence_parallel=true"], load_dir=f"{tmp}/ckpt")
        ).chunks
    )
    assert set(saved) == set(resharded)
    assert sum(".query" in k for k in saved) == 4 * 2 + 1
    for key, value in saved.items():
        assert torch.equal(resharded[key], value), key
    assert float(saved["decoder.final_res.query"].abs().sum()) > 0  # trained away from zero init


@pytest.mark.slow
def test_megatron_parity_two_ranks(tmp_path) -> None:
    """Parity in six layouts, the announced pipeline message sizes, and an SFT checkpoint
    (PP=2 -> TP=2+SP), all in one spawned world."""
    from tests.world import run_world

    run_world(2, _parity_world, str(tmp_path))
