"""SGD-vs-Adam-RLVR (`optimizer.name: sgd`) and OPD-Sparsity (`mcore-rl diagnose update_sparsity`).

SGD: one step is θ − lr·g bit for bit, no optimizer state anywhere (inner state, snapshot, plain and
distributed checkpoints), the shared clipping / skipping / bf16-master / rollback paths, config
validation, and — in one TP=2 gloo world — the exact step under tensor parallelism plus an SFT run
saved and resumed with SGD. Sparsity: every formula on constructed matrices whose answer is known,
and the analysis end to end on two real checkpoints.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

from mcore_rl.config.schema import OptimizerConfig
from mcore_rl.diagnose import update_sparsity as us
from mcore_rl.train.optimizer import PlainSGD, build_optimizer
from tests.helpers import Tiny, _backward

SGD = OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.0, clip_grad=0.0, lr_decay_style="constant")


# ------------------------------------------------------------------------------ SGD step


def test_one_sgd_step_is_exactly_p_minus_lr_g_and_keeps_no_state() -> None:
    model = Tiny()
    opt = build_optimizer([model], SGD, "fp32", 10)
    assert isinstance(opt.optimizer, PlainSGD)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _backward(model, 0)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    out = opt.step()
    assert not out["skipped"] and out["lr"] == 0.1
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n] - 0.1 * grads[n]), n
    assert len(opt.optimizer.state) == 0
    assert opt.optimizer.state_dict()["state"] == {}
    assert all(not s for s in opt.snapshot().state)


def test_torch_sgd_is_not_bit_exact_which_is_why_plain_sgd_exists() -> None:
    """Negative control for the exactness test: the fused θ + (−lr)·g kernel misses by an ulp."""
    torch.manual_seed(0)
    p, g = torch.randn(4096), torch.randn(4096)
    q = p.clone().requires_grad_()
    q.grad = g.clone()
    torch.optim.SGD([q], lr=0.1, foreach=True).step()
    assert not torch.equal(q.detach(), p - 0.1 * g)


def test_weight_decay_decoupled_and_only_on_matrices() -> None:
    cfg = replace(SGD, weight_decay=0.5)
    model = Tiny()
    opt = build_optimizer([model], cfg, "fp32", 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _backward(model, 1)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        wd = 0.5 if p.ndim >= 2 else 0.0
        torch.testing.assert_close(p.detach(), before[n] * (1 - 0.1 * wd) - 0.1 * grads[n], rtol=0, atol=1e-7)


def test_sgd_shares_clipping_skipping_and_schedule() -> None:
    cfg = replace(SGD, clip_grad=0.5, lr_decay_style="linear", min_lr=0.0)
    model = Tiny()
    opt = build_optimizer([model], cfg, "fp32", 4)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, 2, scale=100.0)
    grads = [p.grad.detach().clone() for p in model.parameters()]
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
    out = opt.step()
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-6) and norm > 0.5
    coeff = 0.5 / (norm + 1e-6)
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), b - 0.1 * (g * coeff), rtol=0, atol=1e-7)
    assert opt.get_lr() == pytest.approx(0.075)  # linear decay over 4 updates: the schedule moved
    # a non-finite gradient skips the update and leaves params and schedule alone
    after = [p.detach().clone() for p in model.parameters()]
    _backward(model, 3)
    next(model.parameters()).grad.fill_(float("nan"))
    assert opt.step()["skipped"]
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after))
    assert opt.scheduler.num_steps == 1


def test_snapshot_restore_and_state_dict_roundtrip_bf16() -> None:
    model = Tiny().to(torch.bfloat16)
    opt = build_optimizer([model], SGD, "bf16", 10)
    _backward(model, 4)
    opt.step()
    opt.zero_grad()
    snap = opt.snapshot()
    saved = {k: v for k, v in opt.state_dict().items()}
    masters = {i: m.clone() for i, m in saved["fp32_params"].items()}
    weights = [p.detach().clone() for p in model.parameters()]
    _backward(model, 5)
    opt.step()
    opt.zero_grad()
    assert any(not torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    opt.restore(snap)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert opt.scheduler.num_steps == 1
    assert saved["optimizer"]["state"] == {}
    # a fresh optimizer resumed from the plain state dict takes the same next step
    other = Tiny().to(torch.bfloat16)
    other.load_state_dict(model.state_dict())
    opt2 = build_optimizer([other], SGD, "bf16", 10)
    opt2.load_state_dict({**saved, "fp32_params": masters})
    for m, o in ((model, opt), (other, opt2)):
        _backward(m, 6)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt.main_params, opt2.main_params))


def test_bf16_rounding_hides_tiny_updates_but_fp32_masters_keep_them() -> None:
    """Property 4 of the paper and an open question of its summary: an update below half a bf16 ulp leaves a
    bf16 parameter unchanged; with fp32 masters (train.precision=bf16) it accumulates in the master
    and reaches the bf16 copy once the sum crosses the rounding boundary."""
    one = torch.ones(4, dtype=torch.bfloat16)
    half_ulp = 2.0**-8  # bf16 has 8 significand bits: ulp(1) = 2^-7
    assert torch.equal(one + torch.full_like(one, half_ulp * 0.9), one)
    assert not torch.equal(one + torch.full_like(one, half_ulp * 1.1), one)

    lin = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt = build_optimizer([lin], replace(SGD, lr=1.0), "bf16", 100)
    step = half_ulp * 0.25  # each update is a quarter of half an ulp
    for k in range(1, 6):
        lin.weight.grad = torch.full_like(lin.weight, -step)
        opt.step()
        assert opt.main_params[0][0, 0].item() == pytest.approx(1 + k * step)
        visible = 1 + k * step > 1 + half_ulp
        assert (lin.weight[0, 0].item() != 1.0) == visible, k


def test_config_validation_and_build() -> None:
    from mcore_rl.config import RLConfig, load_config, validate_rl_config
    from mcore_rl.config.errors import ConfigError

    cfg = load_config(RLConfig, "configs/demo.yaml", ["optimizer.name=sgd", "optimizer.lr=0.1"])
    validate_rl_config(cfg, 1)
    assert cfg.optimizer.name == "sgd"
    bad = load_config(RLConfig, "configs/demo.yaml", ["optimizer.name=sgd", "optimizer.backend=deepspeed"])
    with pytest.raises(ConfigError, match="optimizer.backend"):
        validate_rl_config(bad, 1)
    with pytest.raises(Exception, match="optimizer.name"):
        load_config(RLConfig, "configs/demo.yaml", ["optimizer.name=lion"])
    with pytest.raises(ValueError, match="optimizer.name"):
        build_optimizer([Tiny()], replace(SGD, name="lion"), "fp32", 10)  # type: ignore[arg-type]  # an unknown optimizer name on purpose: its refusal is what is tested


def _sharded_state_dict_has_only_masters() -> None:
    """(Run inside the world below: it imports megatron.)"""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = Tiny().to(dtype)
        opt = build_optimizer([model], SGD, precision, 10)
        _backward(model, 7)
        opt.step()
        model_sd = {n: ShardedTensor.from_rank_offsets(n, p, replica_id=0) for n, p in model.named_parameters()}
        sd = opt.sharded_state_dict(model_sd)
        keys = {t.key for t in nested_values(sd) if isinstance(t, ShardedTensor)}
        names = [n for n, _ in model.named_parameters()]
        want = {f"optimizer.state.fp32_param.{n}" for n in names} if precision == "bf16" else set()
        assert keys == want, precision
        assert sd["name"] == "sgd" and sd["optimizer"]["state"] == {"common_step": 0}
        assert len(opt.optimizer.state) == 0  # _init_state made no moments


# ------------------------------------------------------------------------------ LR step decay (MIPU's baseline)


def test_step_decay_constant_then_halving_to_the_floor() -> None:
    from mcore_rl.train.lr_schedule import LRScheduler

    cfg = OptimizerConfig(
        lr=1.0,
        min_lr=0.1,
        lr_decay_style="step",
        lr_warmup_iters=2,
        lr_step_start_iter=5,
        lr_step_period=3,
        lr_step_factor=0.5,
    )
    sched = LRScheduler(cfg, total_iters=100)
    got = [sched.lr_at(s) for s in range(20)]
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125, 0.125] + [0.1] * 6
    assert got == want
    assert sched.lr_at(10_000) == 0.1  # the floor holds past total_iters
    # the position resumes; the shape follows the config
    for _ in range(9):
        sched.step()
    other = LRScheduler(cfg, total_iters=100)
    other.load_state_dict(sched.state_dict())
    assert other.get_lr() == 0.25
    with pytest.raises(ValueError, match="lr_step_period"):
        LRScheduler(replace(cfg, lr_step_period=0), 10)


def test_step_decay_drives_the_optimizer_and_its_keys_validate() -> None:
    from mcore_rl.config import RLConfig, load_config, validate_rl_config
    from mcore_rl.config.errors import ConfigError

    cfg = replace(SGD, lr_decay_style="step", lr_step_start_iter=1, lr_step_period=1, min_lr=0.025)
    model = Tiny()
    opt = build_optimizer([model], cfg, "fp32", 10)
    lrs = []
    for s in range(4):
        _backward(model, s)
        lrs.append(opt.step()["lr"])
        opt.zero_grad()
    assert lrs == [0.1, 0.05, 0.025, 0.025]
    ok = [
        "optimizer.lr_decay_style=step",
        "optimizer.lr_step_start_iter=20",
        "optimizer.lr_step_period=10",
        "optimizer.min_lr=1e-4",
        "optimizer.lr=1e-3",
    ]
    validate_rl_config(load_config(RLConfig, "configs/demo.yaml", ok), 1)
    for bad, key in (
        (["optimizer.lr_step_period=0"], "optimizer.lr_step_period"),
        (["optimizer.lr_step_factor=1.5"], "optimizer.lr_step_factor"),
        (["optimizer.lr_warmup_iters=30"], "optimizer.lr_step_start_iter"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate_rl_config(load_config(RLConfig, "configs/demo.yaml", ok + bad), 1)


# ------------------------------------------------------------------------------ sparsity formulas


def _orthonormal(n: int, k: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def test_sparsity_counts_changes_above_the_threshold_only() -> None:
    theta = torch.randn(10, 20, generator=torch.Generator().manual_seed(0))
    assert us.sparsity(us.delta(theta, theta)) == 1.0
    one = theta.clone()
    one[3, 4] += 1e-3
    assert us.sparsity(us.delta(one, theta)) == 1.0 - 1.0 / 200
    small = theta + 5e-6 * torch.sign(torch.randn_like(theta))  # every coordinate moves, by <= 1e-5
    assert us.sparsity(us.delta(small, theta)) == 1.0
    assert us.sparsity(torch.zeros(0)) == 1.0


def test_top_energy_and_relative_norm() -> None:
    d = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert us.top_energy(d, 1.0) == 1.0
    assert us.top_energy(d, 0.25) == pytest.approx(16 / 25)
    assert us.top_energy(torch.zeros(5), 0.5) == 1.0
    assert us.relative_norm(d, torch.tensor([0.0, 0.0, 6.0, 8.0])) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        us.top_energy(d, 0.0)


def test_rank_one_delta() -> None:
    u, v = _orthonormal(12, 1, 1), _orthonormal(9, 1, 2)
    d = (3.0 * u @ v.T).float()
    assert us.stable_rank(d) == pytest.approx(1.0, rel=1e-6)
    assert us.spectral_energy(d, 1) == pytest.approx(1.0, rel=1e-6)
    assert us.numerical_rank(d, 1e-5) == 1
    assert us.effective_rank(d) == 1
    # negative control: a generic matrix is not rank one by any of these
    g = torch.randn(12, 9, generator=torch.Generator().manual_seed(3))
    assert us.stable_rank(g) > 1.5 and us.numerical_rank(g) == 9 and us.effective_rank(g) > 1


@pytest.mark.parametrize("k", [1, 10, 37, 100, 200])
def test_effective_rank_of_k_equal_singular_values(k: int) -> None:
    n = max(k, 4) + 3
    u, v = _orthonormal(n, k, k), _orthonormal(n + 1, k, k + 1)
    m = (u @ (2.0 * torch.eye(k, dtype=torch.float64)) @ v.T).float()
    assert us.effective_rank(m, 0.99) == math.ceil(0.99 * k)
    assert us.stable_rank(m) == pytest.approx(k, rel=1e-4)
    assert us.spectral_energy(m, 16) == pytest.approx(min(16, k) / k, rel=1e-4)


def test_principal_projection_inside_and_orthogonal_to_the_source_subspace() -> None:
    n, k = 20, 2  # rank fraction 0.1 of 20 -> k = 2
    u, v = _orthonormal(n, n, 5), _orthonormal(n, n, 6)
    sigma = torch.diag(torch.linspace(10.0, 1.0, n, dtype=torch.float64))
    src = (u @ sigma @ v.T).float()
    x = torch.randn(k, k, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    inside = (u[:, :k] @ x @ v[:, :k].T).float()
    y = torch.randn(n - k, n - k, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    outside = (u[:, k:] @ y @ v[:, k:].T).float()
    assert us.principal_projection(inside, src, 0.1) == pytest.approx(1.0, abs=1e-5)
    assert us.principal_projection(outside, src, 0.1) == pytest.approx(0.0, abs=1e-6)
    mixed = us.principal_projection(inside + outside, src, 0.1)
    assert 0.0 < mixed < 1.0


def test_masks_and_coverage() -> None:
    src = torch.arange(1.0, 101.0).reshape(10, 10)
    low = us.low_magnitude_mask(src, 0.1)
    assert int(low.sum()) == 10 and bool(low.flatten()[:10].all())
    d = torch.zeros(10, 10)
    d.view(-1)[:5] = 1.0  # five visible updates on low-magnitude coordinates ...
    d.view(-1)[50:55] = 1.0  # ... and five elsewhere
    vis = us.visible(d)
    assert us.coverage(vis, low) == 0.5
    assert us.coverage(torch.zeros_like(vis), low) == 0.0
    # a rank-1 source: the principal mask holds its largest entries
    r1 = torch.outer(torch.arange(1.0, 11.0), torch.arange(1.0, 11.0))
    prin = us.principal_mask(r1, 0.1, 0.1)
    assert int(prin.sum()) == 10 and bool(prin[-1, -1]) and not bool(prin[0, 0])
    mask = us.subnetwork_mask(src + d, src, 0.5)
    assert int(mask.sum()) == 10


def test_module_types_for_megatron_and_hf_names() -> None:
    cases = {
        "decoder.layers.0.self_attention.linear_qkv.weight": "attn_qkv",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "norm",
        "decoder.layers.1.self_attention.linear_proj.weight": "attn_out",
        "decoder.layers.1.mlp.linear_fc1.weight": "mlp_in",
        "decoder.layers.1.mlp.linear_fc2.weight": "mlp_out",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight": "moe_expert",
        "decoder.layers.1.mlp.router.weight": "router",
        "embedding.word_embeddings.weight": "embedding",
        "output_layer.weight": "output",
        "model.layers.0.self_attn.k_proj.weight": "attn_qkv",
        "model.layers.0.self_attn.o_proj.weight": "attn_out",
        "model.layers.0.mlp.up_proj.weight": "mlp_in",
        "model.layers.0.mlp.down_proj.weight": "mlp_out",
        "model.layers.0.post_attention_layernorm.weight": "norm",
        "lm_head.weight": "output",
    }
    assert {n: us.module_type(n) for n in cases} == cases


def test_compare_reports_per_module_and_pools_overall() -> None:
    g = torch.Generator().manual_seed(9)
    src = {
        "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(8, 6, generator=g),
        "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(6, 6, generator=g),
        "decoder.final_layernorm.weight": torch.ones(6),
    }
    trained = {k: v.clone() for k, v in src.items()}
    trained["decoder.layers.0.mlp.linear_fc1.weight"][2, 3] += 0.5  # one coordinate, FFN only
    out = us.compare(src, trained)
    rows = {r["module"]: r for r in out["by_module"]}
    assert rows["mlp_in"]["sparsity"] == 1 - 1 / 48 and rows["attn_out"]["sparsity"] == 1.0
    assert rows["mlp_in"]["effective_rank"] == 1 and rows["mlp_in"]["rank_tau"] == 1
    assert out["overall"]["params"] == 48 + 36 + 6
    assert out["overall"]["sparsity"] == 1 - 1 / 90
    assert out["overall"]["top0.01_energy"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="different tensors"):
        us.compare(src, {"x": torch.zeros(1)})


# ------------------------------------------------------------------------------ AdamW's effective LR


def test_effective_lr_formula_quantiles_and_decades() -> None:
    from mcore_rl.diagnose import sgd_vs_adam as sa

    v = torch.full((10,), 1e-4)
    raw = sa.effective_lr(v, lr=1e-6, eps=1e-8, bias_correction=False)
    torch.testing.assert_close(raw, torch.full((10,), 1e-6 / (1e-2 + 1e-8), dtype=torch.float64))
    # bias correction after one step: v_hat = v / (1 - beta2)
    one = sa.effective_lr(v, lr=1e-6, eps=0.0, step=1, beta2=0.99)
    torch.testing.assert_close(one, torch.full((10,), 1e-6 / math.sqrt(1e-4 / 0.01), dtype=torch.float64))
    with pytest.raises(ValueError, match="step"):
        sa.effective_lr(v, 1e-6, 1e-8, step=0, beta2=0.95)
    x = torch.tensor([0.5, 2.0, 3.0, 20.0, 50.0, 70.0, 200.0, 0.0])
    assert sa.decade_mass(x) == {"1e-1": 1 / 7, "1e0": 2 / 7, "1e1": 3 / 7, "1e2": 1 / 7}
    assert sa.quantiles(torch.arange(101.0))["q50"] == 50.0
    moments = {
        "decoder.layers.0.mlp.linear_fc1.weight": torch.full((4, 4), 1e-12),  # η_eff = 1e-6 / 1e-6 = 1
        "decoder.layers.0.self_attention.linear_proj.weight": torch.full((2, 2), 1e-10),
    }  # = 0.1
    out = sa.summarize(moments, lr=1e-6, eps=0.0, step=1, beta2=0.0)
    rows = {r["module"]: r for r in out["by_module"]}
    assert rows["mlp_in"]["q50"] == pytest.approx(1.0) and rows["attn_out"]["q50"] == pytest.approx(0.1)
    assert out["suggested_sgd_lr"] == pytest.approx(1.0) and out["suggested_ratio"] == pytest.approx(1e6)
    assert sum(out["decade_mass"].values()) == pytest.approx(1.0)


# ------------------------------------------------------------------------------ masked (subnetwork) training


@pytest.mark.parametrize("name,precision", [("adamw", "fp32"), ("adamw", "bf16"), ("sgd", "fp32")])
def test_update_mask_keeps_frozen_coordinates_bit_identical(name: str, precision: str) -> None:
    """OPD-Sparsity property 3: with weight decay, any number of steps, clipping on."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    cfg = replace(SGD, name=name, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    model = Tiny().to(dtype)
    opt = build_optimizer([model], cfg, precision, 20)
    g = torch.Generator().manual_seed(1)
    masks = {i: torch.rand(p.shape, generator=g) < 0.3 for i, p in enumerate(opt.model_params)}
    opt.set_update_mask(masks)
    start = [p.detach().clone() for p in opt.model_params]
    for s in range(6):
        _backward(model, s)
        opt.step()
        opt.zero_grad()
    for i, (p, p0) in enumerate(zip(opt.model_params, start)):
        assert torch.equal(p.detach()[~masks[i]], p0[~masks[i]]), i
        assert not torch.equal(p.detach()[masks[i]], p0[masks[i]]), i  # the subnetwork did train
    with pytest.raises(ValueError, match="shape"):
        opt.set_update_mask({0: torch.ones(2, 2, dtype=torch.bool)})


def test_zeroing_the_gradient_alone_lets_weight_decay_move_frozen_coordinates() -> None:
    """Negative control for the test above: what the paper warns about."""
    model = Tiny()
    opt = build_optimizer([model], replace(SGD, name="adamw", lr=1e-2, weight_decay=0.1), "fp32", 20)
    p = opt.model_params[0]
    mask = torch.zeros(p.shape, dtype=torch.bool)
    start = p.detach().clone()
    _backward(model, 0)
    p.grad.mul_(mask)  # grads zeroed by hand, no update mask: decay still shrinks every coordinate
    opt.step()
    assert not torch.equal(p.detach(), start)


# ------------------------------------------------------------------------------ one gloo world


def _sgd_world(rank: int, world_size: int, tmp: str) -> None:
    """TP=2: the wrapper's SGD step equals p − lr·(clip·g) on each shard; then an SFT run with SGD is
    saved at 3 steps and resumed to 6 bit-identically, its checkpoint holds no optimizer state, AdamW
    refuses to resume from it, and `update_sparsity` reads two of its checkpoints."""
    from megatron.core import parallel_state as ps

    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.train import sft

    _sharded_state_dict_has_only_masters()
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    g = torch.Generator().manual_seed(0)
    col, col_g = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    norm, norm_g = torch.randn(3, generator=g), torch.randn(3, generator=g)
    m = torch.nn.Module()
    m.col = torch.nn.Parameter(col.chunk(2, dim=0)[rank].clone())
    m.col.tensor_model_parallel = True
    m.norm = torch.nn.Parameter(norm.clone())
    m.col.grad, m.norm.grad = col_g.chunk(2, dim=0)[rank].clone(), norm_g.clone()
    opt = build_optimizer([m], replace(SGD, clip_grad=1.0), "fp32", 10)
    out = opt.step()
    total = math.sqrt(float(col_g.square().sum() + norm_g.square().sum()))
    assert out["grad_norm"] == pytest.approx(total, rel=1e-6)
    coeff = 1.0 / (out["grad_norm"] + 1e-6)  # the all-reduced norm, which may differ from `total` in the last bit
    assert torch.equal(m.col.detach(), col.chunk(2, dim=0)[rank] - 0.1 * (col_g.chunk(2, dim=0)[rank] * coeff))
    assert torch.equal(m.norm.detach(), norm - 0.1 * (norm_g * coeff))
    ps.destroy_model_parallel()

    def cfg(run: str, iters: int, **ck: str) -> SFTConfig:
        overrides = [
            f"run_dir={tmp}/{run}",
            f"train.train_iters={iters}",
            "train.log_interval=100",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.seq_length=32",
            "data.synthetic_num_examples=256",
            "optimizer.name=sgd",
            "optimizer.lr=0.05",
            "optimizer.lr_decay_style=constant",  # the 3-step run keeps the 6-step run's LRs
            "parallel.tensor_model_parallel_size=2",
        ]
        return load_config(SFTConfig, None, overrides + [f"checkpoint.{k}={v}" for k, v in ck.items()])

    full = [r["loss"] for r in sft.run_sft(cfg("a", 6))]
    sft.run_sft(cfg("b", 3, save_dir=f"{tmp}/ckpt"))
    resumed = [
        r["loss"] for r in sft.run_sft(cfg("c", 6, load_dir=f"{tmp}/ckpt", save_dir=f"{tmp}/ckpt", save_interval="1"))
    ]
    assert resumed == full[3:], (resumed, full)
    assert full[-1] < full[0]  # SGD at this rate trains
    if rank == 0:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(f"{tmp}/ckpt/iter_0000003").read_metadata().state_dict_metadata
        assert not [k for k in keys if k.startswith("optimizer.")], sorted(keys)[:5]
        result = us.compare(us.load_weights(f"{tmp}/ckpt/iter_0000003"), us.load_weights(f"{tmp}/ckpt"))
        assert 0.0 <= result["overall"]["sparsity"] < 1.0 and result["overall"]["relative_norm"] > 0
        assert {r["module"] for r in result["by_module"]} >= {"attn_qkv", "mlp_in", "mlp_out", "embedding"}
        _remath_on_dist_checkpoints(tmp)
    adam = load_config(
        SFTConfig,
        None,
        [
            f"run_dir={tmp}/d",
            "parallel.tensor_model_parallel_size=2",
            f"checkpoint.load_dir={tmp}/ckpt",
            "train.seq_length=32",
        ],
    )
    with pytest.raises(ValueError, match="optimizer.name=sgd"):
        sft.build_trainer(adam)
    _adam_effective_lr_of_a_real_checkpoint(tmp)
    _masked_retraining_under_tp2(tmp)


def _adam_effective_lr_of_a_real_checkpoint(tmp: str) -> None:
    """`adam_effective_lr` reads v, lr, eps, beta2 and the step of an AdamW checkpoint and gives the
    live optimizer's numbers; on the SGD checkpoint it says there are no moments."""
    import torch.distributed as dist

    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.diagnose import sgd_vs_adam as sa
    from mcore_rl.models.shards import iter_local_params
    from mcore_rl.train import sft

    cfg = load_config(
        SFTConfig,
        None,
        [
            f"run_dir={tmp}/adam",
            "parallel.tensor_model_parallel_size=2",
            "train.seq_length=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "data.synthetic_num_examples=64",
            "optimizer.lr=1e-3",
            f"checkpoint.save_dir={tmp}/adam_ckpt",
        ],
    )
    trainer = sft.build_trainer(cfg)
    for _ in range(2):
        sft.train_step(trainer)
    path = sft.save(trainer)
    opt = trainer.optimizer
    live = {}  # this rank's shard of the fc2 weight's exp_avg_sq, by global name
    for _, name, p in iter_local_params(trainer.chunks):
        if name == "decoder.layers.0.mlp.linear_fc2.weight":
            i = next(i for i, q in enumerate(opt.model_params) if q is p)
            live[name] = opt.optimizer.state[opt.main_params[i]]["exp_avg_sq"]
    dist.barrier()
    if dist.get_rank() == 0:
        moments, hyper = sa.read_second_moments(path)
        assert hyper == {"lr": 1e-3, "eps": cfg.optimizer.adam_eps, "beta2": cfg.optimizer.adam_beta2, "step": 2}
        stored = moments["decoder.layers.mlp.linear_fc2.weight"][0]  # stacked over layers; fc2 is split on dim 1
        shard = live["decoder.layers.0.mlp.linear_fc2.weight"]
        assert torch.equal(stored[:, : shard.shape[1]], shard)
        out = sa.summarize(moments, **hyper)
        assert out["step"] == 2 and out["suggested_sgd_lr"] > 0
        assert sum(out["decade_mass"].values()) == pytest.approx(1.0)
        with pytest.raises(ValueError, match="optimizer.name=sgd"):
            sa.read_second_moments(f"{tmp}/ckpt")


def _masked_retraining_under_tp2(tmp: str) -> None:
    """`update_sparsity --write-mask` of the SGD run, then `optimizer.update_mask` on a fresh AdamW run
    with weight decay under TP=2 (the mask sliced to each rank's shards): outside the mask the weights
    after three steps are bit-identical to the initial ones, inside they moved."""
    import torch.distributed as dist

    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.train import sft

    if dist.get_rank() == 0:
        out = us.write_mask(
            us.load_weights(f"{tmp}/ckpt/iter_0000003"), us.load_weights(f"{tmp}/ckpt"), 1e-5, f"{tmp}/mask.pt"
        )
        assert 0 < out["density"] < 1, out
    dist.barrier()
    cfg = load_config(
        SFTConfig,
        None,
        [
            f"run_dir={tmp}/masked",
            "parallel.tensor_model_parallel_size=2",
            "train.seq_length=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "data.synthetic_num_examples=64",
            "optimizer.lr=1e-2",
            "optimizer.weight_decay=0.1",
            f"optimizer.update_mask={tmp}/mask.pt",
        ],
    )
    trainer = sft.build_trainer(cfg)
    before = gather_full_state_dict(trainer.chunks)
    for _ in range(3):
        sft.train_step(trainer)
    after = gather_full_state_dict(trainer.chunks)
    masks = torch.load(f"{tmp}/mask.pt", weights_only=True)
    moved = 0
    aliases = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }  # checkpoint key -> param name
    for key, m in masks.items():
        name = next((key.replace(a, b) for a, b in aliases.items() if key.endswith(a)), key)
        assert torch.equal(after[name][~m], before[name][~m]), name
        moved += int((after[name][m] != before[name][m]).sum())
    assert moved > 0 and len(masks) == len(after)


def _remath_on_dist_checkpoints(tmp: str) -> None:
    """test_remath.py's tool on real megatron checkpoints (iter 3 → 4 → 6 of the run above): the
    HF dir it writes holds the victim's values on exactly the rolled-back neurons."""
    from mcore_rl.convert.hf_checkpoint import HFCheckpoint
    from mcore_rl.diagnose import remath as rm

    before, victim, interfered = (us.load_weights(f"{tmp}/ckpt/iter_{i:07d}") for i in (3, 4, 6))
    layers = rm.mlp_neurons(interfered)
    g = torch.Generator().manual_seed(0)
    acts = [{layer: torch.rand(f, generator=g) for layer, (f, _) in layers.items()} for _ in range(2)]
    new, summary = rm.plan(before, victim, interfered, *acts, budget=0.1)
    assert summary["rolled_back"] == math.ceil(0.1 * summary["neurons"]) > 0
    rm.write_result(new, f"{tmp}/ckpt", f"{tmp}/rolled_back")
    hf = HFCheckpoint(f"{tmp}/rolled_back")
    for layer, (f, _) in layers.items():
        gate = hf[f"model.layers.{layer}.mlp.gate_proj.weight"]
        fc1_v = victim[f"decoder.layers.{layer}.mlp.linear_fc1.weight"][:f]
        fc1_i = interfered[f"decoder.layers.{layer}.mlp.linear_fc1.weight"][:f]
        back = [i for i in range(f) if torch.equal(gate[i], fc1_v[i]) and not torch.equal(gate[i], fc1_i[i])]
        row = next(r for r in summary["by_layer"] if r["layer"] == layer)
        assert len(back) == row["rolled_back"], (layer, back, row)


@pytest.mark.slow
def test_sgd_under_tp2_and_sft_resume(tmp_path) -> None:
    from tests.world import run_world

    run_world(2, _sgd_world, str(tmp_path))
    assert os.path.exists(tmp_path / "ckpt" / "latest")
