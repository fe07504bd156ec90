"""LatentMoE (arXiv:2601.18089): reference block, megatron-core layer in TP/SP/PP/EP layouts, cost report.

Fast tests check the paper's testable properties on the reference model (alpha=1 identity
equivalence, shapes, linearity of W_up, KV-cache decoding, configs and weight names) and the cost
report's closed forms against measurements on the built modules. The slow tests spawn gloo worlds:
parity with the reference for TP=2+SP, PP=2, EP=2 (and TPxEP on 4 ranks), the all-to-all buffer
shapes under EP=2 (the payload is K*l elements per token), parameter counts of the built
megatron-core layer, and a checkpoint saved with EP=2 that loads into TP=2.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 96


def _report_tool():
    """benchmarks/latent_moe_report.py as a module (benchmarks/ is not a package)."""
    import sys

    if "latent_moe_report" not in sys.modules:
        spec = importlib.util.spec_from_file_location("latent_moe_report", ROOT / "benchmarks" / "latent_moe_report.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["latent_moe_report"]


def hf_cfg(**kw):
    from mcore_rl.hf import McoreRLConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_latent_size=16,
    )
    base.update(kw)
    return McoreRLConfig(**base)


def make_model(cfg, seed: int = 0):
    from mcore_rl.hf import McoreRLForCausalLM

    torch.manual_seed(seed)
    model = McoreRLForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # sharp router: routing decisions are not ties
    return model


def ids(b: int = 2, s: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# ---- reference block: the paper's properties -----------------------------------------------------


def test_alpha_one_with_identity_projections_equals_standard_moe() -> None:
    """Property 1: l = d and W_down = W_up = I give the standard MoE, bit for bit."""
    latent = make_model(hf_cfg(moe_latent_size=32, shared_expert_intermediate_size=16))
    plain = make_model(hf_cfg(moe_latent_size=None, shared_expert_intermediate_size=16))
    state = {k: v for k, v in latent.state_dict().items() if "latent_proj" not in k}
    plain.load_state_dict(state)
    with torch.no_grad():
        for layer in latent.model.layers:
            layer.mlp.fc1_latent_proj.weight.copy_(torch.eye(32))
            layer.mlp.fc2_latent_proj.weight.copy_(torch.eye(32))
        x = torch.randn(5, 32)
        assert torch.equal(latent.model.layers[0].mlp(x)[0], plain.model.layers[0].mlp(x)[0])
        assert torch.equal(latent(ids()).logits, plain(ids()).logits)


def test_shapes_and_linearity_of_the_up_projection() -> None:
    """Property 4: router [N', d]; experts l -> m -> l; shared experts and output at d;
    W_up after the weighted combine equals sum_i p_i W_up E_i(W_down x)."""
    from mcore_rl.hf.modeling import route

    d, latent, n, m = 32, 8, 16, 24
    block = (
        make_model(
            hf_cfg(moe_latent_size=latent, num_experts=n, num_experts_per_tok=3, shared_expert_intermediate_size=20)
        )
        .model.layers[0]
        .mlp
    )
    assert block.gate.weight.shape == (n, d)
    assert block.fc1_latent_proj.weight.shape == (latent, d)
    assert block.fc2_latent_proj.weight.shape == (d, latent)
    assert all(
        e.gate_proj.weight.shape == (m, latent) and e.down_proj.weight.shape == (latent, m) for e in block.experts
    )
    assert block.shared_expert.gate_proj.weight.shape == (20, d)
    x = torch.randn(7, d)
    with torch.no_grad():
        out, _ = block(x)
        probs, idx = route(block.gate(x), 3, True)
        z = block.fc1_latent_proj(x)
        expected = block.shared_expert(x)
        for t in range(7):
            for slot in range(3):
                expert = block.experts[int(idx[t, slot])]
                expected[t] += probs[t, slot] * block.fc2_latent_proj(expert(z[t]))
    assert out.shape == (7, d)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_kv_cache_decode_equals_full_forward() -> None:
    model = make_model(hf_cfg(shared_expert_intermediate_size=16, router_aux_loss_coef=0.01))
    x = ids(b=2, s=8)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :3], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(3, 8):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_aux_loss_and_gradients_reach_the_projections() -> None:
    model = make_model(hf_cfg(router_aux_loss_coef=0.01))
    x = ids()
    out = model(x[:, :-1], labels=x[:, 1:])
    (out.loss + out.aux_loss).backward()
    assert float(out.aux_loss.detach()) > 0
    for layer in model.model.layers:
        for p in (layer.mlp.fc1_latent_proj.weight, layer.mlp.fc2_latent_proj.weight, layer.mlp.gate.weight):
            assert p.grad is not None and float(p.grad.abs().sum()) > 0


# ---- configs, names, checkpoints ------------------------------------------------------------------


LATENT = ModelConfig.of(
    arch="qwen3_moe",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_latent_size=16,
    moe_aux_loss_coeff=0.01,
)
LATENT_SHARED = LATENT.replace(
    moe_shared_expert_intermediate_size=48,
    moe_norm_topk_prob=False,
    moe_router_topk=4,
)


def test_model_config_round_trip_and_no_stock_equivalent() -> None:
    from mcore_rl.hf import hf_config_from_model_config, model_config_from_hf_config, to_stock_hf_config

    hf = hf_config_from_model_config(LATENT_SHARED)
    assert hf.moe_latent_size == 16 and hf.to_dict()["moe_latent_size"] == 16
    assert model_config_from_hf_config(hf) == LATENT_SHARED
    plain = LATENT.replace(moe_latent_size=None)
    assert hf_config_from_model_config(plain).moe_latent_size is None
    with pytest.raises(ValueError, match="moe_latent_size"):
        to_stock_hf_config(hf_config_from_model_config(LATENT_SHARED.replace(moe_shared_expert_intermediate_size=None)))


def test_weight_names_round_trip() -> None:
    from mcore_rl.hf import hf_config_from_model_config
    from mcore_rl.hf.weight_map import full_megatron_to_hf, hf_to_megatron

    model = make_model(hf_config_from_model_config(LATENT_SHARED))
    hf = model.state_dict()
    mg = hf_to_megatron(hf, LATENT_SHARED)
    assert mg["decoder.layers.1.mlp.fc1_latent_proj.weight"].shape == (16, 64)
    assert mg["decoder.layers.1.mlp.fc2_latent_proj.weight"].shape == (64, 16)
    assert mg["decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight"].shape == (64, 16)
    back = full_megatron_to_hf(mg, LATENT_SHARED)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_save_and_load_pretrained_including_remote_code(tmp_path) -> None:
    """In-process registered classes; and, in a fresh interpreter that never imports mcore_rl, the
    hf/ files as trust_remote_code modules (modeling.py imports latent_moe.py lazily)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    cfg = hf_cfg(shared_expert_intermediate_size=16)
    model = make_model(cfg)
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    model.save_pretrained(tmp_path / "local")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "local").eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, want)

    remote = tmp_path / "remote"
    cfg.auto_map = {
        "AutoConfig": "configuration.McoreRLConfig",
        "AutoModelForCausalLM": "modeling.McoreRLForCausalLM",
    }
    model.save_pretrained(remote)
    from transformers.dynamic_module_utils import get_relative_import_files

    modeling = ROOT / "mcore_rl" / "hf" / "modeling.py"
    needed = [modeling] + [Path(f) for f in get_relative_import_files(str(modeling))]
    assert "latent_moe.py" in {f.name for f in needed}
    for source in needed:
        shutil.copy(source, remote / source.name)
    torch.save({"x": x, "want": want}, tmp_path / "io.pt")
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(remote)!r}, trust_remote_code=True).eval()
assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
assert type(m.model.layers[0].mlp).__name__ == "ReferenceLatentMoeBlock"
assert "mcore_rl" not in sys.modules
io = torch.load({str(tmp_path / "io.pt")!r})
with torch.no_grad():
    assert torch.equal(m(io["x"]).logits, io["want"])
"""
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_validation_names_the_key() -> None:
    from mcore_rl.config import ConfigError, SFTConfig, validate_sft_config

    def errors(**model) -> str:
        cfg = SFTConfig(model=LATENT.replace(**model))
        with pytest.raises(ConfigError) as e:
            validate_sft_config(cfg, 1)
        return str(e.value)

    validate_sft_config(SFTConfig(model=LATENT), 1)
    assert "model.moe_latent_size: 65 exceeds hidden_size 64" in errors(moe_latent_size=65)
    assert "model.moe_latent_size: must be null or >= 1" in errors(moe_latent_size=0)
    assert "model.moe_latent_size: is 16 but LatentMoE needs model.arch=qwen3_moe" in errors(
        arch="qwen3", num_experts=0
    )


# ---- the cost report ------------------------------------------------------------------------------


def test_report_closed_forms_equal_measurements() -> None:
    """The paper's three configurations at a small d, m: closed forms == counts on built modules,
    and property 3 (routed params 3Ndm for all; active routed 3Kdm/alpha vs 3Kdm) and property 2
    (payload K*d, K*d/alpha, K*d)."""
    tool = _report_tool()
    d, m, n, k, alpha, b = 64, 16, 64, 6, 4, 2
    result = tool.report(d, m, shared_intermediate=40, bytes_per_elem=b)
    assert all(r["ok"] for r in result.values()), result
    base, eff, acc = (result[c]["measured"] for c in ("baseline", "eff", "acc"))
    assert base.routed_params == eff.routed_params == acc.routed_params == 3 * n * d * m
    assert eff.params - base.params == 2 * d * (d // alpha) + d * n * (alpha - 1)  # W_down/W_up + router
    assert (base.active_routed_params, eff.active_routed_params, acc.active_routed_params) == (
        3 * k * d * m,
        3 * k * d * m // alpha,
        3 * k * d * m,
    )
    assert (base.a2a_bytes_per_token, eff.a2a_bytes_per_token, acc.a2a_bytes_per_token) == (
        2 * k * d * b,
        2 * k * d * b // alpha,
        2 * k * d * b,
    )
    assert base.flops_per_token == 2 * base.active_params
    # Principles I and II of the paper (GB200): t_exp threshold 1418 and ratio 9.04.
    assert int(tool.memory_bound_threshold(4096, 1536)) == 1418
    assert round(tool.comm_compute_ratio(1536), 2) == 9.04
    assert tool.memory_bound_threshold(256, 64) == float("inf")


def test_report_tool_runs(capsys, tmp_path) -> None:
    tool = _report_tool()
    assert tool.main(["--d", "128", "--m", "32", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "a2a_bytes_per_token" in out and "MISMATCH" not in out
    assert os.path.getsize(tmp_path / "r.json") > 0


# ---- megatron-core: multi-rank worlds ---------------------------------------------------------------

# Tiny configurations of the paper's three variants for the all-to-all buffer check (d=32, alpha=2).
A2A_CASES = {
    "baseline": ModelConfig.of(
        arch="qwen3_moe",
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=64,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
    ),
}
A2A_CASES["eff"] = A2A_CASES["baseline"].replace(num_experts=8, moe_latent_size=16)
A2A_CASES["acc"] = A2A_CASES["eff"].replace(moe_router_topk=4)


def _all_to_all_payload(rank: int) -> None:
    """Property 2 on the real buffers: under EP=2 the dispatcher's all-to-all carries K*l elements
    per token (baseline K*d, eff K*d/alpha, acc alpha*K*d/alpha = K*d)."""
    from megatron.core.transformer.moe import token_dispatcher

    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from tests.helpers import P

    pc = P(ep=2)
    original = token_dispatcher.all_to_all
    calls: list[tuple[torch.Size, torch.Size]] = []

    def recording(group, tensor, *args, **kwargs):
        out = original(group, tensor, *args, **kwargs)
        if tensor.dim() == 2:  # tokens (the routing probabilities travel as a 1-D tensor)
            calls.append((tensor.shape, out.shape))
        return out

    payload = {}
    token_dispatcher.all_to_all = recording
    try:
        for name, mc in A2A_CASES.items():
            init_model_parallel(pc)
            set_seed(3)
            (model,) = build_model(mc, pc)
            tokens = torch.randint(0, mc.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
            calls.clear()
            with torch.no_grad():
                model(tokens, torch.arange(16).expand(2, 16), None)
            (dispatch_in, _), (_, combine_out) = calls  # one layer: dispatch, then combine
            width = mc.section(LatentMoEKeys).moe_latent_size or mc.hidden_size
            assert dispatch_in[1] == combine_out[1] == width, (name, calls)
            payload[name] = dispatch_in.numel() / tokens.numel()
            assert payload[name] == combine_out.numel() / tokens.numel() == mc.section(MoEKeys).moe_router_topk * width
    finally:
        token_dispatcher.all_to_all = original
    assert payload == {"baseline": 2 * 32, "eff": 2 * 32 / 2, "acc": 2 * 32}, payload


def _megatron_params_match_closed_form(chunks_state: dict, mc: ModelConfig) -> None:
    experts = mc.section(MoEKeys)
    tool = _report_tool()
    alpha = mc.hidden_size // mc.section(LatentMoEKeys).moe_latent_size
    closed = tool.closed_form(
        mc.hidden_size,
        experts.moe_ffn_hidden_size,
        alpha,
        experts.num_experts,
        experts.moe_router_topk,
        experts.moe_shared_expert_intermediate_size or 0,
    )
    layer = {k: v for k, v in chunks_state.items() if k.startswith("decoder.layers.0.mlp.")}
    assert sum(v.numel() for v in layer.values()) == closed.params
    routed = sum(v.numel() for k, v in layer.items() if ".local_experts." in k)
    assert routed == closed.routed_params


def _checkpoint_reshards(tmp: str, mc: ModelConfig, ref_state: dict) -> None:
    """A model-only dist checkpoint saved with EP=2 loads into TP=2+SP with identical weights
    (the duplicated projections are replicated tensors, like the router)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.checkpoint import _model_sharded_state_dict
    from tests.helpers import P

    path = os.path.join(tmp, "latent_ckpt")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    init_model_parallel(P(ep=2))
    set_seed(1)
    chunks = build_model(mc, P(ep=2))
    load_full_state_dict(chunks, hf_to_megatron(ref_state, mc))
    saved = gather_full_state_dict(chunks)
    _megatron_params_match_closed_form(saved, mc)
    dist_checkpointing.save({"model": _model_sharded_state_dict(chunks)}, path)
    dist.barrier()

    pc = P(tp=2, sp=True)
    init_model_parallel(pc)
    set_seed(2)  # different initial weights: only the load can make them equal
    chunks = build_model(mc, pc)
    loaded = dist_checkpointing.load({"model": _model_sharded_state_dict(chunks)}, path)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"][f"chunk{i}"], strict=True)
    again = gather_full_state_dict(chunks)
    assert set(again) == set(saved)
    for key, value in saved.items():
        assert torch.equal(again[key], value), key


def _two_rank_world(rank: int, world_size: int, tmp: str) -> None:
    from tests.helpers import P, _global_batch
    from tests.helpers import _layouts_world, _parity_reference

    _all_to_all_payload(rank)
    _layouts_world(
        rank,
        world_size,
        [
            (LATENT, P(tp=2, sp=True)),
            (LATENT, P(pp=2)),  # 1F1B, 4 micro-batches
            (LATENT, P(ep=2)),
            (LATENT_SHARED, P(ep=2)),
            (LATENT_SHARED, P(tp=2, sp=True)),
        ],
    )
    _, ref_state, _ = _parity_reference(LATENT_SHARED, _global_batch(LATENT_SHARED.vocab_size))
    _checkpoint_reshards(tmp, LATENT_SHARED, ref_state)


@pytest.mark.slow
def test_two_rank_layouts_payload_and_checkpoint(tmp_path) -> None:
    from tests.world import run_world

    run_world(2, _two_rank_world, str(tmp_path))


def _four_rank_world(rank: int, world_size: int) -> None:
    from tests.helpers import P
    from tests.helpers import _layouts_world

    _layouts_world(
        rank,
        world_size,
        [
            (LATENT, P(tp=2, ep=2, sp=True)),  # expert-TP 2 (= TP)
            (LATENT_SHARED, P(tp=2, ep=2, sp=True, etp=1)),
        ],
    )


@pytest.mark.slow
def test_four_rank_tp_x_ep_layouts() -> None:
    from tests.world import run_world

    run_world(4, _four_rank_world)
