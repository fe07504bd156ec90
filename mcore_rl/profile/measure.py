"""`--measure`: a few real training steps of chosen layouts on this machine, under `torch.profiler`.

Each layout runs in its own spawned world (gloo on CPU, NCCL on GPU) through the trainer's own
builders: `build_model`, `wrap_ddp`, `build_optimizer`, `forward_backward`. What is measured:

* model state, by counting the real tensors: the chunks' unique parameters, the DDP grad
  buffers, the optimizer's state tensors and fp32 masters (after a step has created them);
* the activation peak: the highest net allocation during one forward/backward with the model
  state already in place — from the profiler's memory events on CPU (`profile_memory=True`), from
  `torch.cuda.max_memory_allocated` on GPU — maximised over ranks;
* the step time: the median wall time of the timed steps (forward/backward + optimizer);
* on CPU, each rank's matmul rate (`calibrate_cpu`, on the model's own GEMM shape) just before
  the timed steps: it replaces `cpu_here`'s placeholder peak in the estimate the measured step is
  compared with, so the ratio compares the model of the step with the step, not with a guess, on
  a machine whose load changes.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from mcore_rl.config.schema import ModelConfig
from mcore_rl.profile.layouts import Layout, TrainShape


def calibrate_cpu(
    m: int = 512,
    k: int = 512,
    n: int = 512,
    seconds: float = 0.3,
    threads: int = 1,
    precisions: tuple[str, ...] = ("fp32", "bf16"),
) -> dict[str, float]:
    """Achieved matmul FLOP/s of one CPU thread (each gloo rank runs with one) on an [m, k] x [k, n]
    product: the best of repeats over `seconds`, so a busy moment of a shared machine counts less."""
    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    for name in precisions:
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        out[name] = 2.0 * m * k * n / best
    return out


def model_matmul(model: ModelConfig, shape: TrainShape) -> tuple[int, int, int]:
    """The shape of the model's typical GEMM (a micro-batch's tokens through the MLP's fc1)."""
    return shape.seq_length * shape.micro_batch_size, model.hidden_size, model.ffn_hidden_size


def _batches(model: ModelConfig, shape: TrainShape, num_microbatches: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    s, b = shape.seq_length, shape.micro_batch_size
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, model.vocab_size, (b, s), generator=g)
        out.append(
            dict(
                tokens=tokens,
                labels=torch.roll(tokens, -1, 1),
                loss_mask=torch.ones(b, s),
                position_ids=torch.arange(s).expand(b, s).contiguous(),
            )
        )
    return out


def _unique_bytes(tensors: Any) -> tuple[int, int]:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values()), len(seen)


def count_model_state(chunks: list[torch.nn.Module], optimizer: Any) -> dict[str, int]:
    """Bytes of the real tensors: parameters, DDP grad buffers, optimizer state and masters."""
    params, num_tensors = _unique_bytes(p for c in chunks for p in c.parameters())
    num_params = len({id(p): 0 for c in chunks for p in c.parameters()})
    grads = 0
    for c in chunks:
        for buf in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", [])):
            grads += buf.grad_data.numel() * buf.grad_data.element_size()
    state = [v for st in optimizer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    masters = [m for m, has in zip(optimizer.main_params, optimizer._has_master) if has]
    opt_bytes, _ = _unique_bytes(state + masters)
    numel = sum(p.numel() for p in {id(p): p for c in chunks for p in c.parameters()}.values())
    return {"params": params, "grads": grads, "optimizer": opt_bytes, "num_params": numel, "num_tensors": num_params}


def _cpu_peak(prof: Any) -> int:
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    run = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        run += e.nbytes()
        peak = max(peak, run)
    return peak


def _measure_rank(
    rank: int,
    world_size: int,
    store: str,
    model: ModelConfig,
    layouts: list[Layout],
    shape: TrainShape,
    steps: int,
    queue: Any,
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from mcore_rl.parallel import cpu_compat  # lazy: patches megatron-core

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        cpu_compat.apply()
    dist.init_process_group(
        "nccl" if on_gpu else "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    from megatron.core import parallel_state

    try:
        for k, layout in enumerate(layouts):  # one world for all layouts: its start costs the most
            result = _measure_one(model, layout, shape, steps, on_gpu)
            queue.put({"layout": k, "rank": rank, **result})
            parallel_state.destroy_model_parallel()
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _measure_one(model: ModelConfig, layout: Layout, shape: TrainShape, steps: int, on_gpu: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_rl.config.schema import OptimizerConfig  # lazy: patches megatron-core
    from mcore_rl.models.builder import build_model, transformer_config  # lazy: megatron
    from mcore_rl.parallel import setup  # lazy: numpy
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp  # lazy: megatron
    from mcore_rl.train.optimizer import build_optimizer  # lazy: numpy

    parallel = layout.parallel_config()
    setup.init_model_parallel(parallel)
    setup.set_seed(1234)
    config = transformer_config(model, parallel, shape.precision, shape.recompute)
    chunks = wrap_ddp(build_model(model, parallel, config=config), config)
    prepare_config(config, chunks)
    opt_cfg = OptimizerConfig(name=shape.optimizer, lr=1e-4)  # type: ignore[arg-type]  # the layout's optimizer is a plain str naming one of the same two optimizers
    optimizer = build_optimizer(chunks, opt_cfg, shape.precision, 100)
    m = shape.global_batch_size // (shape.micro_batch_size * layout.dp)
    batches = _batches(model, shape, m, seed=parallel_state.get_data_parallel_rank())
    for c in chunks:
        c.train()
    forward_backward(chunks, batches)  # the first step creates the optimizer state
    optimizer.step()
    state = count_model_state(chunks, optimizer)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward_backward(chunks, batches)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            forward_backward(chunks, batches)
        peak = _cpu_peak(prof)
    optimizer.step()
    rate = 0.0
    if not on_gpu:  # this rank's matmul rate now, under the same load as the steps it times
        rate = calibrate_cpu(*model_matmul(model, shape), precisions=(shape.precision,))[shape.precision]
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        forward_backward(chunks, batches)
        optimizer.step()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "state": state,
        "activation_peak": peak,
        "step_s": statistics.median(times),
        "matmul_flops": rate,
    }


def measure_layouts(
    model: ModelConfig, layouts: list[Layout], shape: TrainShape, steps: int = 3
) -> list[dict[str, Any]]:
    """Run `steps` timed steps of each layout (all of one world size) in one fresh world; per layout
    and pipeline rank: the measured model state, the activation peak (max over that stage's ranks),
    and the slowest rank's step time."""
    world = {lay.world_size for lay in layouts}
    if len(world) != 1:
        raise ValueError(f"layouts to measure must share one world size, got {sorted(world)}")
    n = world.pop()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _measure_rank,
            args=(n, os.path.join(tmp, "store"), model, layouts, shape, steps, queue),
            nprocs=n,
            join=True,
            start_method="spawn",
        )
    rows = [queue.get() for _ in range(n * len(layouts))]
    out = []
    for k in range(len(layouts)):
        stages: dict[int, dict[str, Any]] = {}
        mine = [r for r in rows if r["layout"] == k]
        for r in mine:
            st = stages.setdefault(r["pp_rank"], {"state": r["state"], "activation_peak": 0})
            st["activation_peak"] = max(st["activation_peak"], r["activation_peak"])
        out.append(
            {
                "stages": stages,
                "step_s": max(r["step_s"] for r in mine),
                "matmul_flops": min(r["matmul_flops"] for r in mine),
            }
        )
    return out
