"""The project's AdamW wrapper and LR schedule: numerics against torch's AdamW, bf16 masters,
clipping, skipping, rollback, checkpoints, and the grad norm under a real TP=2 gloo world."""

from __future__ import annotations

import copy
import io
import math
from dataclasses import replace

import pytest
import torch

from mcore_rl.config.schema import OptimizerConfig
from mcore_rl.train.lr_schedule import LRScheduler
from mcore_rl.train.optimizer import build_optimizer, load_deepspeed_cpu_adam
from tests.helpers import Tiny, _backward

BASE = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, lr_decay_style="constant", lr_warmup_iters=0)


def _torch_reference(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        foreach=True,
    )


def _assert_params_equal(a: torch.nn.Module, b: torch.nn.Module, **tol: float) -> None:
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if tol:
            torch.testing.assert_close(pa, pb, **tol, msg=na)
        else:
            assert torch.equal(pa, pb), na


# ------------------------------------------------------------------------------ LR schedule


def test_lr_warmup_then_constant() -> None:
    s = LRScheduler(replace(BASE, lr=1.0, lr_warmup_iters=4, lr_decay_style="constant"), 10)
    lrs = [s.lr_at(i) for i in range(12)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:] == [1.0] * 8


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_lr_decay_shapes(style: str) -> None:
    cfg = replace(BASE, lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style=style)
    s = LRScheduler(cfg, total_iters=12)  # decay over updates 2..12
    assert s.lr_at(0) == 0.5 and s.lr_at(1) == 1.0 and s.lr_at(2) == 1.0
    assert s.lr_at(7) == pytest.approx(0.55)  # halfway: both shapes pass the midpoint
    assert s.lr_at(12) == pytest.approx(0.1) and s.lr_at(50) == pytest.approx(0.1)
    mid_quarter = s.lr_at(4.5)
    if style == "linear":
        assert mid_quarter == pytest.approx(0.1 + 0.9 * 0.75)
    else:
        assert mid_quarter == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    lrs = [s.lr_at(i) for i in range(2, 13)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_lr_state_roundtrip() -> None:
    cfg = replace(BASE, lr_decay_style="cosine", lr_warmup_iters=3)
    a, b = LRScheduler(cfg, 20), LRScheduler(cfg, 20)
    for _ in range(7):
        a.step()
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 7 and b.get_lr() == a.get_lr()


# ------------------------------------------------------------------------------ fp32 numerics


def test_fp32_step_matches_torch_adamw() -> None:
    model, ref = Tiny(), Tiny()
    opt = build_optimizer([model], BASE, "fp32", total_iters=10)
    ref_opt = _torch_reference(ref, BASE)
    for step in range(4):
        _backward(model, step)
        _backward(ref, step)
        out = opt.step()
        ref_opt.step()
        assert not out["skipped"] and out["lr"] == BASE.lr
        opt.zero_grad()
        ref_opt.zero_grad()
    _assert_params_equal(model, ref)


def test_no_weight_decay_on_1d_params() -> None:
    model = Tiny()
    opt = build_optimizer([model], BASE, "fp32", total_iters=10)
    decayed, plain = opt.optimizer.param_groups
    assert decayed["weight_decay"] == BASE.weight_decay and plain["weight_decay"] == 0.0
    assert {id(p) for p in plain["params"]} == {id(model.fc.bias), id(model.norm.weight), id(model.norm.bias)}


def test_scheduler_drives_lr() -> None:
    cfg = replace(BASE, lr_warmup_iters=2)
    model = Tiny()
    opt = build_optimizer([model], cfg, "fp32", total_iters=10)
    lrs = []
    for step in range(3):
        _backward(model, step)
        lrs.append(opt.step()["lr"])
        opt.zero_grad()
    assert lrs == pytest.approx([cfg.lr / 2, cfg.lr, cfg.lr])


def test_main_grad_is_preferred() -> None:
    """With megatron DDP the reduced gradient is in `main_grad`; `.grad` is stale or None."""
    model, ref = Tiny(), Tiny()
    opt = build_optimizer([model], BASE, "fp32", total_iters=10)
    ref_opt = _torch_reference(ref, BASE)
    _backward(ref, 0)
    for p, r in zip(model.parameters(), ref.parameters()):
        p.main_grad = r.grad.clone()
        p.grad = torch.full_like(p, 1e3)  # garbage that must be ignored
    opt.step()
    ref_opt.step()
    _assert_params_equal(model, ref)
    # `.grad` must not keep aliasing `main_grad`: DDP's hook would then add the next grad twice
    assert all(p.grad is None for p in model.parameters())


def test_clipping_scales_to_max_norm() -> None:
    cfg = replace(BASE, clip_grad=0.5)
    model, ref = Tiny(), Tiny()
    opt = build_optimizer([model], cfg, "fp32", total_iters=10)
    ref_opt = _torch_reference(ref, cfg)
    _backward(model, 0, scale=100.0)
    _backward(ref, 0, scale=100.0)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip_grad).item()
    out = opt.step()
    ref_opt.step()
    assert out["grad_norm"] == pytest.approx(expected, rel=1e-5) and expected > 10 * cfg.clip_grad
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped.item() == pytest.approx(cfg.clip_grad, rel=1e-4)
    _assert_params_equal(model, ref, rtol=1e-6, atol=1e-7)


def test_non_finite_grad_skips_step() -> None:
    model = Tiny()
    opt = build_optimizer([model], replace(BASE, clip_grad=1.0), "fp32", total_iters=10)
    before = copy.deepcopy(model.state_dict())
    _backward(model, 0)
    model.fc.weight.grad[0, 0] = float("nan")
    out = opt.step()
    assert out["skipped"] and not math.isfinite(out["grad_norm"])
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert opt.scheduler.num_steps == 0 and len(opt.optimizer.state) == 0
    _backward(model, 1)
    assert not opt.step()["skipped"]


# ------------------------------------------------------------------------------ bf16 masters


def test_bf16_keeps_fp32_masters() -> None:
    """Updates of 1e-4 are below half a bf16 ulp at 1.0: a bf16-only AdamW never moves; the
    master-weight path accumulates them and the bf16 param follows once they add up."""
    cfg = replace(BASE, lr=1e-4, weight_decay=0.0)
    w = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    holder = torch.nn.Module()
    holder.w = w
    opt = build_optimizer([holder], cfg, "bf16", total_iters=100)
    master = opt.main_params[0]
    assert master.dtype == torch.float32 and master is not w

    naive = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    naive_opt = torch.optim.AdamW([naive], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(30):
        w.grad = torch.ones_like(w)
        naive.grad = torch.ones_like(naive)
        opt.step()
        naive_opt.step()
        opt.zero_grad()
        if step == 0:
            assert master[0, 0].item() == pytest.approx(1 - 1e-4, abs=1e-7)
            assert torch.all(w == 1.0)
    assert torch.all(naive == 1.0)
    assert master[0, 0].item() == pytest.approx(1 - 30e-4, abs=1e-6)
    assert torch.equal(w, master.to(torch.bfloat16)) and torch.all(w < 1.0)


def test_fp32_precision_rejects_bf16_params() -> None:
    with pytest.raises(ValueError, match="train.precision"):
        build_optimizer([Tiny().to(torch.bfloat16)], BASE, "fp32", total_iters=10)


# --------------------------------------------------------------------- rollback, checkpoints


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_snapshot_restore_bit_identical(precision: str) -> None:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = Tiny().to(dtype)
    opt = build_optimizer([model], replace(BASE, clip_grad=1.0, lr_warmup_iters=3), precision, 20)

    def run(steps: range) -> None:
        for s in steps:
            _backward(model, s)
            opt.step()
            opt.zero_grad()

    run(range(2))
    snap = opt.snapshot()
    params0 = [p.detach().clone() for p in model.parameters()]
    masters0 = [m.detach().clone() for m in opt.main_params]
    state0 = {i: copy.deepcopy(opt.optimizer.state[m]) for i, m in enumerate(opt.main_params)}
    run(range(2, 5))
    after_first = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(after_first, params0))

    for _ in range(2):  # a snapshot can be restored more than once
        opt.restore(snap)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params0))
        assert all(torch.equal(m, q) for m, q in zip(opt.main_params, masters0))
        for i, m in enumerate(opt.main_params):
            for k, v in state0[i].items():
                now = torch.as_tensor(opt.optimizer.state[m][k])
                assert torch.equal(now, torch.as_tensor(v)), k
        assert opt.scheduler.num_steps == 2
        run(range(2, 5))  # replaying the same updates lands on the same bits
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_first))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_roundtrip(precision: str) -> None:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    cfg = replace(BASE, lr_warmup_iters=2)
    a, b = Tiny().to(dtype), Tiny(seed=1).to(dtype)
    opt_a = build_optimizer([a], cfg, precision, 20)
    opt_b = build_optimizer([b], cfg, precision, 20)
    for s in range(3):
        _backward(a, s)
        opt_a.step()
        opt_a.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["optim"])
    assert opt_b.scheduler.num_steps == 3
    for s in range(3, 5):
        for m, o in ((a, opt_a), (b, opt_b)):
            _backward(m, s)
            o.step()
            o.zero_grad()
    _assert_params_equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(opt_a.main_params, opt_b.main_params))


def _plain_sharded_sd(model: torch.nn.Module, prefix: str = "") -> dict:
    """What a megatron module's `sharded_state_dict()` gives for a TP=1 model."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        f"{prefix}{n}": ShardedTensor.from_rank_offsets(f"{prefix}{n}", p, replica_id=0)
        for n, p in model.named_parameters()
    }


def _materialize(sharded: object) -> object:
    """Stand-in for `dist_checkpointing.load` in one process: tensors and local objects back."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(sharded, dict):
        return {k: _materialize(v) for k, v in sharded.items()}
    if isinstance(sharded, list):
        return [_materialize(v) for v in sharded]
    if isinstance(sharded, ShardedTensor):
        return sharded.data.detach().clone()
    if isinstance(sharded, LocalNonpersistentObject):
        return sharded.unwrap()
    return copy.deepcopy(sharded)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sharded_state_dict_keys_and_roundtrip(precision: str) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    a, b = Tiny().to(dtype), Tiny().to(dtype)
    opt_a = build_optimizer([a], BASE, precision, 20)
    opt_b = build_optimizer([b], BASE, precision, 20)
    for s in range(2):
        _backward(a, s)
        opt_a.step()
        opt_a.zero_grad()
    sd = opt_a.sharded_state_dict(_plain_sharded_sd(a, "decoder."))
    keys = {t.key for t in nested_values(sd) if isinstance(t, ShardedTensor)}
    names = [n for n, _ in a.named_parameters()]
    expected = {f"optimizer.state.{k}.decoder.{n}" for k in ("exp_avg", "exp_avg_sq") for n in names}
    if precision == "bf16":
        expected |= {f"optimizer.state.fp32_param.decoder.{n}" for n in names}
        assert all(t.dtype == torch.float32 for t in nested_values(sd) if isinstance(t, ShardedTensor))
    assert keys == expected
    assert sd["optimizer"]["state"]["common_step"] == 2

    b.load_state_dict(a.state_dict())
    # the structure built for loading (zero state before any step) loads too
    zeros = opt_b.sharded_state_dict(_plain_sharded_sd(b), is_loading=True)
    opt_b.load_sharded_state_dict(_materialize(zeros))
    opt_b.load_sharded_state_dict(_materialize(sd))
    for s in range(2, 4):
        for m, o in ((a, opt_a), (b, opt_b)):
            _backward(m, s)
            o.step()
            o.zero_grad()
    _assert_params_equal(a, b)


# ------------------------------------------------------------------------------ deepspeed backend


def test_deepspeed_rejects_non_cpu_params() -> None:
    model = Tiny().to("meta")
    with pytest.raises(ValueError, match="optimizer.backend"):
        build_optimizer([model], replace(BASE, backend="deepspeed"), "fp32", 10)


def test_deepspeed_cpu_adam_matches_torch() -> None:
    """Builds DeepSpeed's cpu_adam op on first use (about a minute, then cached)."""
    try:
        load_deepspeed_cpu_adam()
    except RuntimeError as exc:
        pytest.skip(f"DeepSpeedCPUAdam unavailable: {exc}")
    cfg = replace(BASE, clip_grad=1.0)
    ds_model, ref = Tiny(), Tiny()
    ds = build_optimizer([ds_model], replace(cfg, backend="deepspeed"), "fp32", 10)
    tr = build_optimizer([ref], cfg, "fp32", 10)
    for s in range(4):
        for m, o in ((ds_model, ds), (ref, tr)):
            _backward(m, s)
            o.step()
            o.zero_grad()
    _assert_params_equal(ds_model, ref, rtol=1e-6, atol=1e-6)
    # moments see grads of params that already differ by ~1e-7, hence the looser tolerance
    for md, mr in zip(ds.main_params, tr.main_params):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ds.optimizer.state[md][k], tr.optimizer.state[mr][k], rtol=1e-4, atol=1e-8)
    # a torch-backend checkpoint resumes on the deepspeed backend (step type converted)
    ds.load_state_dict(tr.state_dict())
    assert isinstance(ds.optimizer.state[ds.main_params[0]]["step"], int)
    _backward(ds_model, 9)
    assert not ds.step()["skipped"]


# ------------------------------------------------------------------------------ TP=2 over gloo


def _tp2_worker(rank: int, world_size: int, ckpt_dir: str) -> None:
    """Each rank holds half of a column-parallel weight and of an expert weight, a full copy of
    a TP-duplicated norm weight, and a `shared` tied-embedding copy that must not be counted."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import load, save
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    g = torch.Generator().manual_seed(0)
    full = {  # the same on both ranks
        "col": torch.randn(4, 3, generator=g),
        "col_g": torch.randn(4, 3, generator=g),
        "exp": torch.randn(6, 2, generator=g),
        "exp_g": torch.randn(6, 2, generator=g),
        "norm": torch.randn(3, generator=g),
        "norm_g": torch.randn(3, generator=g),
        "emb": torch.randn(5, 3, generator=g),
        "emb_g": torch.randn(5, 3, generator=g),
    }

    def make(shard: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        sl = (lambda t: t.chunk(2, dim=0)[rank]) if shard else (lambda t: t)
        m.col = torch.nn.Parameter(sl(full["col"]).clone())
        m.exp = torch.nn.Parameter(sl(full["exp"]).clone())
        m.norm = torch.nn.Parameter(full["norm"].clone())
        m.emb = torch.nn.Parameter(full["emb"].clone())
        if shard:
            m.col.tensor_model_parallel = True
            m.exp.tensor_model_parallel = True
            m.exp.allreduce = False  # an expert param
            m.emb.shared = True
        m.col.grad, m.exp.grad = sl(full["col_g"]).clone(), sl(full["exp_g"]).clone()
        m.norm.grad, m.emb.grad = full["norm_g"].clone(), full["emb_g"].clone()
        return m

    cfg = replace(BASE, clip_grad=1.0)
    tp = make(shard=True)
    opt = build_optimizer([tp], cfg, "fp32", 10)
    out = opt.step()
    expected = math.sqrt(sum(full[k].pow(2).sum().item() for k in ("col_g", "exp_g", "norm_g")))
    assert out["grad_norm"] == pytest.approx(expected, rel=1e-6), (out, expected)

    # Same update as one process holding the full (unsharded) tensors, emb excluded from norm.
    ref = make(shard=False)
    ref.emb.requires_grad_(False)
    ref_opt = _torch_reference(ref, cfg)
    torch.nn.utils.clip_grad_norm_([ref.col, ref.exp, ref.norm], cfg.clip_grad)
    ref_opt.step()
    torch.testing.assert_close(tp.col, ref.col.chunk(2, dim=0)[rank], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tp.norm, ref.norm, rtol=1e-6, atol=1e-7)

    # Save with TP=2, load where every rank holds the full tensor (a TP=1 layout).
    def model_sd(m: torch.nn.Module, shard: bool) -> dict:
        if shard:
            return {
                "col": ShardedTensor.from_rank_offsets("col", m.col, (0, rank, 2)),
                "exp": ShardedTensor.from_rank_offsets("exp", m.exp, (0, rank, 2)),
                "norm": ShardedTensor.from_rank_offsets("norm", m.norm, replica_id=rank),
                "emb": ShardedTensor.from_rank_offsets("emb", m.emb, replica_id=rank),
            }
        return {n: ShardedTensor.from_rank_offsets(n, p, replica_id=rank) for n, p in m.named_parameters()}

    save({"optimizer": opt.sharded_state_dict(model_sd(tp, True))}, ckpt_dir)
    whole = make(shard=False)
    whole_opt = build_optimizer([whole], cfg, "fp32", 10)
    loaded = load({"optimizer": whole_opt.sharded_state_dict(model_sd(whole, False), True)}, ckpt_dir)
    whole_opt.load_sharded_state_dict(loaded["optimizer"])
    assert whole_opt.scheduler.num_steps == 1
    name_of = {id(p): n for n, p in whole.named_parameters()}
    tp_by_name = dict(tp.named_parameters())
    for m in whole_opt.main_params:
        n = name_of[id(m)]
        for k in ("exp_avg", "exp_avg_sq"):
            gathered = [torch.empty_like(opt.optimizer.state[tp_by_name[n]][k]) for _ in range(2)]
            dist.all_gather(gathered, opt.optimizer.state[tp_by_name[n]][k])
            want = torch.cat(gathered) if n in ("col", "exp") else gathered[0]
            assert torch.equal(whole_opt.optimizer.state[m][k], want), (n, k)
        assert int(whole_opt.optimizer.state[m]["step"]) == 1


@pytest.mark.slow
def test_tp2_grad_norm_and_resharded_checkpoint(tmp_path) -> None:
    from tests.world import run_world

    (tmp_path / "ckpt").mkdir()
    run_world(2, _tp2_worker, str(tmp_path / "ckpt"))
