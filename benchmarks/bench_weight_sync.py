"""Weight-sync throughput of each transport vs one raw `torch.distributed.broadcast` (the limit).

Why: a sync moves the whole model every RL step; this shows what each transport costs on top of
the fastest thing the wire can do — one broadcast of one tensor of the same total size between the
same two processes over the same kind of group (gloo here, NCCL on GPUs).

    .venv/bin/python benchmarks/bench_weight_sync.py                      # ~315 MB of fp32 weights
    .venv/bin/python benchmarks/bench_weight_sync.py --hidden 512 --bucket-mb 64 --repeats 5
    .venv/bin/python benchmarks/bench_weight_sync.py --no-checksum         # transports alone
    .venv/bin/python benchmarks/bench_weight_sync.py --profile             # where the time goes, both sides

Setup: the "trainer" is this process holding the full HF-named weights of a Qwen3-style model
(the output of the megatron-core gather, which is not timed: it is TP/EP all-gathers whose cost
is the interconnect's); the engine is an `mcore-rl serve` server (`EngineServer` over an
`EngineCore`) in another process. Each transport's time runs from the first byte to the engine
reporting success with every weight copied into its model: pause, HTTP requests, (de)serialising,
broadcasts or files, loading, version bump, continue. Joining the broadcast group happens once,
before timing (as in training, where it is set up once). The raw broadcast goes to a separate
receiver process and ends with a one-element all-reduce, so the time includes delivery.
`in-process` loads into an `EngineCore` in this process (a colocated engine). By default each sync
is made as `WeightSync` makes it: the trainer's checksum taken while bucketing, and every engine's
`/weights_checksum` compared before it resumes (`--no-checksum`: the transport alone). The
transports run round-robin, `--repeats` rounds, so that load from other processes on a shared
machine hits them alike; best, median and worst times are printed, and the ratio of the best and
of the median to the raw broadcast's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mcore_rl.config.schema import ModelConfig
from mcore_rl.rollout.weight_protocol import init_custom_process_group
from mcore_rl.rollout.pool import HTTPEnginePool
from mcore_rl.rollout.weight_transports import (
    DiskTransport,
    DistributedTransport,
    InProcessTransport,
    SyncStats,
    TensorTransport,
)
from mcore_rl.train.weight_sync import iter_buckets


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        max_position_embeddings=256,
    )


def make_core(mc: ModelConfig, seed: int):
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.core import EngineCore

    torch.manual_seed(seed)
    return EngineCore(McoreRLForCausalLM(hf_config_from_model_config(mc)), load_tokenizer(None), context_length=128)


# --profile: what is timed in each process, as (module, attribute, label)
TRAINER_PHASES = [
    ("mcore_rl.rollout.weight_transports", "flatten", "flatten the bucket (staging copy)"),
    ("mcore_rl.rollout.weight_transports", "broadcast_tensors", "broadcast (incl. waiting for the engine)"),
    ("mcore_rl.rollout.weight_transports", "write_safetensors", "write safetensors"),
    ("mcore_rl.rollout.pool.HTTPEnginePool", "verify", "check /weights_checksum"),
    ("mcore_rl.rollout.weight_protocol.WeightChecksum", "wait", "wait for the trainer's digests"),
]
ENGINE_PHASES = [
    ("mcore_rl.rollout.weight_receiver", "broadcast_tensors", "receive the broadcast(s)"),
    ("mcore_rl.rollout.weight_receiver", "_load_files", "read safetensors into the model"),
    ("mcore_rl.rollout.engine.core.EngineCore", "load_weights", "load_weights (copies, refresh)"),
    ("mcore_rl.rollout.engine.core.EngineCore", "flush_cache", "flush_cache"),
    ("mcore_rl.rollout.weight_protocol", "tensor_digest", "digests (worker thread; overlaps)"),
]


class Phases:
    """Wall time per labelled function, for --profile (wrappers installed in this process)."""

    def __init__(self, phases: list[tuple[str, str, str]]) -> None:
        import functools
        import importlib

        self.times: dict[str, float] = {}
        for where, attr, label in phases:
            parts = where.split(".")
            try:
                owner = importlib.import_module(where)
            except ImportError:  # a class: import its module, then take the attribute
                owner = getattr(importlib.import_module(".".join(parts[:-1])), parts[-1], None)
            fn = getattr(owner, attr, None)
            if fn is None:  # not in this version of the code (the tool also profiles older commits)
                continue

            def timed(*a, _fn=fn, _label=label, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.times[_label] = self.times.get(_label, 0.0) + time.perf_counter() - t0

            setattr(owner, attr, functools.wraps(fn)(timed))

    def take(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


def _server(mc: ModelConfig, urls, stop, commands=None, replies=None) -> None:
    from mcore_rl.rollout.engine.driver import EngineDriver
    from mcore_rl.rollout.server import EngineServer, ServerThread

    phases = Phases(ENGINE_PHASES) if commands is not None else None
    server = ServerThread(EngineServer(EngineDriver(make_core(mc, seed=0))))
    urls.put(server.start())
    while phases is not None and commands.get() == "take":
        replies.put(phases.take())
    stop.wait()
    server.stop()


def _raw_receiver(port: int, nbytes: int, repeats: int) -> None:
    group = init_custom_process_group("gloo", "127.0.0.1", port, 1, 2, "raw", timedelta(minutes=10))
    buf = torch.empty(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1)
    for _ in range(repeats):
        dist.broadcast(buf, group=group, group_src=0)
        dist.all_reduce(ack, group=group)
    dist.destroy_process_group(group)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--bucket-mb", type=int, default=512, help="bucket size in MiB (the default of the sync)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-checksum", action="store_true", help="do not checksum and check the engines (as before)")
    p.add_argument("--profile", action="store_true", help="time the phases of each sync in both processes")
    p.add_argument("--only", default="", help="run only the transports whose name contains this")
    args = p.parse_args()

    mc = model_config(args)
    weights = list(make_core(mc, seed=1).model.state_dict().items())  # the "trainer's" full HF tensors
    total = sum(t.numel() * t.element_size() for _, t in weights)
    bucket = args.bucket_mb << 20
    print(
        f"weights: {total / 1e6:.1f} MB fp32 in {len(weights)} tensors (hidden {mc.hidden_size}, "
        f"{mc.num_layers} layers, vocab {mc.vocab_size}); bucket {args.bucket_mb} MiB; "
        f"{args.repeats} runs each; checksums {'off' if args.no_checksum else 'on'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    if not args.no_checksum:
        from mcore_rl.rollout.weight_protocol import WeightChecksum

        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            c = WeightChecksum()
            for name, t in weights:
                c.add(name, t)
            c.hexdigest()
            times.append(time.perf_counter() - t0)
        print(
            f"checksum of all weights (one side): best {min(times):.3f} s, median {statistics.median(times):.3f} s "
            f"({total / min(times) / 1e9:.1f} GB/s)"
        )

    ctx = mp.get_context("spawn")
    urls, stop = ctx.Queue(), ctx.Event()
    commands, replies = (ctx.Queue(), ctx.Queue()) if args.profile else (None, None)
    server = ctx.Process(target=_server, args=(mc, urls, stop, commands, replies), daemon=True)
    server.start()
    url = urls.get(timeout=600)
    results: dict[str, list[float]] = {}
    tmp = tempfile.TemporaryDirectory()
    transports = {}
    pool = None
    try:
        # the limit: one broadcast of one tensor of the same size, to a bare receiver process
        port = free_port()
        receiver = ctx.Process(target=_raw_receiver, args=(port, total, args.repeats), daemon=True)
        receiver.start()
        group = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, "raw", timedelta(minutes=10))
        flat = torch.randint(0, 255, (total,), dtype=torch.uint8)
        ack = torch.zeros(1)

        def raw() -> None:
            dist.broadcast(flat, group=group, group_src=0)
            dist.all_reduce(ack, group=group)

        pool = HTTPEnginePool([url])
        transports = {
            "distributed, one broadcast per tensor": DistributedTransport(pool, group_name="bench-per-tensor"),
            "distributed, flattened bucket": DistributedTransport(
                pool, group_name="bench-flat", load_format="flattened_bucket"
            ),
            "disk (safetensors files)": DiskTransport(pool, os.path.join(tmp.name, "w")),
            "tensor, shared-memory file": TensorTransport(pool),
            "tensor, inline (base64 in JSON)": TensorTransport(pool, payload="inline"),
            "in-process (colocated EngineCore)": InProcessTransport([make_core(mc, seed=0)]),
        }
        for t in transports.values():
            if isinstance(t, DistributedTransport):
                t.connect()  # once, as in training
        phases = Phases(TRAINER_PHASES) if args.profile else None
        profile: dict[str, dict[str, float]] = {}
        versions = iter(range(1, 1 << 30))
        # round-robin, so that load from other processes on a shared machine hits all alike
        for _ in range(args.repeats):
            for name, fn in [
                ("raw dist.broadcast, one tensor", raw),
                *[(k, t) for k, t in transports.items() if args.only in k],
            ]:
                t0 = time.perf_counter()
                if fn is raw:
                    raw()
                elif args.no_checksum:
                    v = next(versions)
                    fn.send(iter_buckets(weights, bucket), v, SyncStats(v))
                else:
                    v = next(versions)
                    stats = SyncStats(v, checksum=WeightChecksum(background=True))  # as WeightSync makes it
                    fn.send(iter_buckets(weights, bucket, stats.checksum), v, stats)
                    assert not stats.mismatched, stats.mismatched
                results.setdefault(name, []).append(time.perf_counter() - t0)
                if phases is not None and fn is not raw:
                    commands.put("take")
                    sides = {
                        **{f"trainer: {k}": v for k, v in phases.take().items()},
                        **{f"engine: {k}": v for k, v in replies.get(timeout=60).items()},
                    }
                    for k, v in sides.items():
                        profile.setdefault(name, {})[k] = profile.get(name, {}).get(k, 0.0) + v / args.repeats
        receiver.join()
        dist.destroy_process_group(group)
    finally:
        for t in transports.values():
            if isinstance(t, (DistributedTransport, TensorTransport)):
                t.close()
        if pool is not None:
            pool.close()
        tmp.cleanup()
        if commands is not None:
            commands.put("stop")
        stop.set()
        server.join(30)

    raw_times = results["raw dist.broadcast, one tensor"]
    print(
        f"\n{'transport':<40} {'best s':>7} {'median s':>9} {'worst s':>8} {'MB/s (median)':>14} "
        f"{'vs raw, best':>13} {'vs raw, median':>15}"
    )
    for name, times in results.items():
        med = statistics.median(times)
        print(
            f"{name:<40} {min(times):>7.3f} {med:>9.3f} {max(times):>8.3f} {total / med / 1e6:>14.0f} "
            f"{min(raw_times) / min(times):>13.0%} {statistics.median(raw_times) / med:>15.0%}"
        )
    if args.profile:
        print("\nwhere the time goes, ms per sync (mean; phases overlap: the engine works while the trainer waits)")
        for name, parts in profile.items():
            print(f"{name} ({statistics.mean(results[name]) * 1e3:.0f} ms)")
            for k, v in sorted(parts.items()):
                print(f"    {k:<58} {v * 1e3:>7.1f}")


if __name__ == "__main__":
    main()
