"""Cluster-scale simulation of the asynchronous runtime: the real `RolloutScheduler` on a virtual clock.

    .venv/bin/python benchmarks/simulate_async.py                 # the default table, ~256 GPUs, 7B, 512x16
    .venv/bin/python benchmarks/simulate_async.py --trainer-gpus 64 --staleness 0,1 --slice 1   # full size

Nothing here schedules: the scheduler (`mcore_rl/runtime/scheduler.py`: staleness gate, buffer,
partial rollouts, stale-group policy) is the one `mcore-rl train` runs, driven by the learner loop
of `mcore_rl/runtime/simulation.py: simulate_learner` on a `VirtualTimeLoop`. What is simulated is
the world around it: inference instances under continuous batching (`ContinuousBatchingEngines`,
`DecodeModel`), long-tailed answers (`ResponseLengths`), a trainer whose step time follows the
FLOPs of the batch, and a weight sync that pauses the engines (SGLang `pause_generation(abort)`).

For each trainer:inference split and each staleness bound s it prints, side by side: the
steady-state step time, steps per hour, trained samples and tokens per second, trainer utilisation
(time training / wall), inference busy (instance-time with a request) and occupancy (running
requests / slots), decode tokens per inference GPU per second, the staleness of the trained tokens
(mean and max lag), the stale groups dropped, tokens decoded and prefilled per trained token (waste
and the re-prefill of continued requests), the mean trained response, and the ratio of trained
tokens per second to the synchronous schedule (s = 0) on the same split and to a colocated
synchronous run (all GPUs generate, then all train: the baseline the published 2.3-2.8x are
measured against). Rows marked "keep" run `stale_policy="keep"`: every group the gate admitted is
trained, instead of dropping the ones whose oldest token is more than s versions old at batch
time (the default rule).

Scale: a step of 512 prompts x 16 answers of ~5k tokens is 8192 requests and ~40M tokens. The
default simulates a 1/`--slice` slice of the cluster (prompts per step, inference instances and
trainer GPUs all divided by it, so every instance sees the load it would in the full cluster) and
counts tokens in units of `--unit` real tokens; `--slice 1 --unit 1` is the full cluster, token by
token (minutes). The constants and where they come from are in `Scenario` and docs/async_runtime.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from mcore_rl.runtime.scheduler import RolloutScheduler, SchedulerConfig
from mcore_rl.runtime.simulation import (
    ContinuousBatchingEngines,
    DecodeModel,
    LengthsBackend,
    ResponseLengths,
    run_simulated,
    simulate_learner,
)


@dataclass(frozen=True)
class Scenario:
    """Everything the simulation assumes. Defaults: a Qwen2.5-7B-shaped dense model on H100s, the
    batch shape and response cap of verl's fully-async 7B experiment (512 prompts x 16, 28k)."""

    # model (Qwen2.5-7B config: 28 layers, hidden 3584, 4 KV heads x 128, bf16)
    params: float = 7.6e9
    layers: int = 28
    hidden: int = 3584
    kv_bytes_per_token: float = 28 * 2 * 4 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16
    # hardware (H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB)
    peak_flops: float = 989e12
    hbm_bytes_per_s: float = 3.35e12
    hbm_bytes: float = 80e9
    # inference instance (SGLang-like): efficiencies are assumptions
    tp: int = 2
    bw_efficiency: float = 0.7  # achieved / peak HBM bandwidth in decode
    decode_compute_efficiency: float = 0.5  # of peak, for the per-sequence matmul work of a decode step
    prefill_efficiency: float = 0.5  # of peak in prefill
    step_overhead_s: float = 2e-3  # per decode step: scheduling, sampling, TP all-reduce latency
    slots: int = 256  # max running requests per instance
    mem_fraction: float = 0.85  # of GPU memory for weights + KV cache (SGLang mem_fraction_static)
    # trainer (megatron-core): MFU is an assumption below Megatron-LM's published "up to 47%"
    train_mfu: float = 0.35
    train_passes: float = 4.0  # forward+backward (3 forwards) + the pi_old recompute (1); +1 with a KL reference
    async_train_passes: float | None = None  # passes in runs with s > 0 (verl's async skips pi_old: 3); None = same
    train_step_overhead_s: float = 2.0  # optimizer step, gradient reduction tail, batch broadcast
    # weight sync: 15.2 GB of bf16 weights at verl's measured 8.25 GB/s NCCL broadcast, + 1 s pause/resume
    weight_sync_s: float = 3.0
    # colocated: switching the GPUs between engine and trainer each step (verl's colocated 128-GPU
    # 7B step minus its gen, old_log_prob and update_actor: 356.30 - 177.85 - 53.92 - 113.81 s)
    colocated_switch_s: float = 10.7
    # batch and data
    total_gpus: int = 256
    prompts_per_step: int = 512
    group_size: int = 16
    prompt_tokens: int = 256
    lengths: ResponseLengths = field(default_factory=ResponseLengths)
    # runtime
    stale_policy: str = "drop"
    partial_rollouts: bool = True
    # simulation size
    slice: int = 8
    token_unit: int = 64
    steps: int = 16
    warmup: int = 4
    seed: int = 0

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params

    def decode_model(self) -> DecodeModel:
        tp = self.tp
        kv_bytes = tp * self.hbm_bytes * self.mem_fraction - self.weight_bytes
        return DecodeModel(
            step_fixed_s=self.weight_bytes / (tp * self.hbm_bytes_per_s * self.bw_efficiency) + self.step_overhead_s,
            step_per_seq_s=2.0 * self.params / (tp * self.peak_flops * self.decode_compute_efficiency),
            step_per_ctx_token_s=self.kv_bytes_per_token / (tp * self.hbm_bytes_per_s * self.bw_efficiency),
            prefill_per_token_s=2.0 * self.params / (tp * self.peak_flops * self.prefill_efficiency),
            prefill_per_token2_s=2.0 * self.layers * self.hidden / (tp * self.peak_flops * self.prefill_efficiency),
            slots=self.slots,
            kv_tokens=kv_bytes / self.kv_bytes_per_token,
        )

    def sample_train_flops(self, total_tokens: float) -> float:
        """Trainer FLOPs for one packed sequence of prompt + response: dense 2N per token per
        forward plus causal attention 2 L d l^2, times the passes."""
        attention = 2.0 * self.layers * self.hidden * total_tokens**2
        return self.train_passes * (2.0 * self.params * total_tokens + attention)

    def train_time(self, groups: list, trainer_gpus: int, passes: float | None = None) -> float:
        u = self.token_unit
        flops = sum(self.sample_train_flops((len(s.prompt.ids) + len(s.response_ids)) * u) for g in groups for s in g)
        if passes is not None:
            flops *= passes / self.train_passes
        return flops / (trainer_gpus * self.peak_flops * self.train_mfu) + self.train_step_overhead_s


@dataclass(frozen=True)
class Config:
    label: str
    trainer_gpus: int  # full-cluster counts
    inference_gpus: int
    max_staleness: int
    colocated: bool = False
    keep_admitted: bool = False


def configs(
    scn: Scenario, trainer_gpus: list[int], staleness: list[int], colocated: bool = True, keep: list[int] = ()
) -> list[Config]:
    out = [Config("colocated", scn.total_gpus, scn.total_gpus, 0, True)] if colocated else []
    for t in trainer_gpus:
        for s in staleness:
            out.append(Config(f"{t}:{scn.total_gpus - t}", t, scn.total_gpus - t, s))
        for s in keep:
            out.append(Config(f"{t}:{scn.total_gpus - t} keep", t, scn.total_gpus - t, s, keep_admitted=True))
    return out


def _sliced(scn: Scenario, cfg: Config) -> tuple[int, int, int]:
    """Prompts per step, inference instances and trainer GPUs of the simulated slice."""
    k, tp = scn.slice, scn.tp
    for what, n in (
        ("prompts per step", scn.prompts_per_step),
        ("trainer GPUs", cfg.trainer_gpus),
        ("inference GPUs", cfg.inference_gpus),
    ):
        if n % k:
            raise SystemExit(f"{what} ({n}) must be divisible by --slice {k}")
    if (cfg.inference_gpus // k) % tp:
        raise SystemExit(f"inference GPUs per slice ({cfg.inference_gpus // k}) must be divisible by --tp {tp}")
    return scn.prompts_per_step // k, cfg.inference_gpus // k // tp, cfg.trainer_gpus // k


def simulate(scn: Scenario, cfg: Config) -> dict[str, Any]:
    """One run of the real scheduler on a slice of the cluster; steady-state measures over the steps
    after `warmup`."""
    batch, instances, trainer_gpus = _sliced(scn, cfg)
    u = scn.token_unit
    marks: dict[int, tuple[float, dict[str, float]]] = {}

    async def go():
        engines = ContinuousBatchingEngines(instances, scn.decode_model(), token_unit=u)
        backend = LengthsBackend(
            engines, lengths=scn.lengths, prompt_tokens=scn.prompt_tokens, token_unit=u, seed=scn.seed
        )
        sch = RolloutScheduler(
            backend,
            SchedulerConfig(
                group_size=scn.group_size,
                batch_groups=batch,
                max_staleness=cfg.max_staleness,
                stale_policy="keep" if cfg.keep_admitted else scn.stale_policy,
                partial_rollouts=scn.partial_rollouts,
            ),
        )
        stats: list[dict[str, float]] = []
        loop = asyncio.get_running_loop()

        def on_step(k: int, groups: list, m: dict[str, float]) -> None:
            tokens = sum(len(s.response_ids) for g in groups for s in g) * u
            stats.append(
                {
                    "tokens": float(tokens),
                    "samples": float(sum(len(g) for g in groups)),
                    "stale_mean": m["async/staleness_mean"],
                    "stale_max": m["async/staleness_max"],
                    "dropped": m["async/dropped_stale"],
                    "regenerated": m["async/regenerated_stale"],
                    "wait": m["async/trainer_wait_s"],
                    "continued": m["async/partial_continued"],
                }
            )
            if k in (scn.warmup - 1, scn.steps - 1):
                marks[k] = (loop.time(), engines.counters())

        switch = scn.colocated_switch_s if cfg.colocated else scn.weight_sync_s
        passes = scn.async_train_passes if cfg.max_staleness > 0 else None
        run = await simulate_learner(
            sch,
            engines,
            scn.steps,
            lambda g: scn.train_time(g, trainer_gpus, passes),
            sync_time=switch,
            on_step=on_step,
        )
        sch.ledger.check(sch.pending())
        report = sch.ledger.report(sch.pending(), scn.group_size)
        attempts = [n + 1 for n in backend._attempts.values()]
        report["max_attempts_per_sample"] = max(attempts, default=0)
        report["samples_tried_3_or_more_times"] = sum(a >= 3 for a in attempts)
        return run, stats, report

    t0 = time.process_time()
    run, stats, ledger = run_simulated(go())
    cpu_s = time.process_time() - t0
    w, n = scn.warmup, scn.steps
    (ta, ca), (tb, cb) = marks[w - 1], marks[n - 1]
    window = tb - ta
    win = stats[w:]
    trained = sum(x["samples"] for x in win)
    dropped_groups = sum(x["dropped"] for x in win)
    tokens = sum(x["tokens"] for x in win)
    slots = instances * scn.slots
    inf_gpus = instances * scn.tp
    step_s = window / (n - w)
    return {
        "label": cfg.label,
        "trainer_gpus": cfg.trainer_gpus,
        "inference_gpus": cfg.inference_gpus,
        "max_staleness": cfg.max_staleness,
        "colocated": cfg.colocated,
        "keep_admitted": cfg.keep_admitted,
        "step_s": step_s,
        "steps_per_h": 3600.0 / step_s,
        "samples_per_s": trained / window * scn.slice,
        "tokens_per_s": tokens / window * scn.slice,
        "trainer_util": sum(run.train_times[w:]) / window,
        "train_s": sum(run.train_times[w:]) / (n - w),
        "trainer_wait_s": sum(x["wait"] for x in win) / (n - w),
        "inference_busy": (cb["busy_s"] - ca["busy_s"]) / (window * instances),
        "inference_occupancy": (cb["occupancy_s"] - ca["occupancy_s"]) / (window * slots),
        "decode_tok_per_s_per_gpu": (cb["decoded"] - ca["decoded"]) / window / inf_gpus,
        "generated_per_trained": (cb["decoded"] - ca["decoded"]) / max(tokens, 1.0),
        "prefill_per_trained": (cb["prefilled"] - ca["prefilled"]) / max(tokens, 1.0),
        "staleness_mean": sum(x["stale_mean"] for x in win) / len(win),
        "staleness_max": max(x["stale_max"] for x in stats),
        "dropped_frac": dropped_groups / max(dropped_groups + trained / scn.group_size, 1.0),
        "mean_response_tokens": tokens / max(trained, 1.0),
        "ledger": ledger,
        "sim_wall_s": run.wall_s,
        "cpu_s": cpu_s,
        "step_times": [b - a for a, b in zip([0.0] + run.step_ends, run.step_ends)],
    }


def _simulate_star(args: tuple[Scenario, Config]) -> dict[str, Any]:
    return simulate(*args)


def run_all(scn: Scenario, cfgs: list[Config], jobs: int = 1) -> list[dict[str, Any]]:
    if jobs <= 1 or len(cfgs) == 1:
        results = [simulate(scn, c) for c in cfgs]
    else:
        order = sorted(range(len(cfgs)), key=lambda i: -cfgs[i].max_staleness)  # the slow ones first
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            done = list(pool.map(_simulate_star, [(scn, cfgs[i]) for i in order]))
        results = [None] * len(cfgs)
        for i, r in zip(order, done):
            results[i] = r
    coloc = next((r for r in results if r["colocated"]), None)
    sync = {
        r["trainer_gpus"]: r
        for r in results
        if not r["colocated"] and r["max_staleness"] == 0 and not r["keep_admitted"]
    }
    for r in results:
        base = sync.get(r["trainer_gpus"]) if not r["colocated"] else None
        # ratios of trained tokens per second: a schedule that drops long answers trains cheaper steps
        r["x_sync"] = r["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
        r["x_colocated"] = r["tokens_per_s"] / coloc["tokens_per_s"] if coloc else math.nan
    return results


COLUMNS = [  # header, key, format
    ("trainer:infer", "label", "{:>13}"),
    ("s", "max_staleness", "{:>2}"),
    ("step s", "step_s", "{:>7.1f}"),
    ("steps/h", "steps_per_h", "{:>7.1f}"),
    ("samples/s", "samples_per_s", "{:>9.1f}"),
    ("ktok/s", "tokens_per_s", "{:>7.0f}"),
    ("train%", "trainer_util", "{:>6.0%}"),
    ("inf busy", "inference_busy", "{:>8.0%}"),
    ("inf occ", "inference_occupancy", "{:>7.0%}"),
    ("tok/s/infGPU", "decode_tok_per_s_per_gpu", "{:>12.0f}"),
    ("stale", "staleness_mean", "{:>5.2f}"),
    ("max", "staleness_max", "{:>3.0f}"),
    ("dropped", "dropped_frac", "{:>7.1%}"),
    ("gen/train", "generated_per_trained", "{:.2f}"),
    ("prefill/train", "prefill_per_trained", "{:.2f}"),
    ("resp tok", "mean_response_tokens", "{:>8.0f}"),
    ("x sync", "x_sync", "{:>6.2f}"),
    ("x coloc", "x_colocated", "{:>7.2f}"),
]


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        cells = []
        for _, k, fmt in COLUMNS:
            v = r[k] / 1000.0 if k == "tokens_per_s" else r[k]
            cells.append("-" if isinstance(v, float) and math.isnan(v) else fmt.format(v).strip())
        rows.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in rows)) for i, (h, _, _) in enumerate(COLUMNS)]
    line = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731  (a one-line helper, local to this table)
    head = line([h for h, _, _ in COLUMNS])
    return "\n".join([head, "-" * len(head)] + [line(c) for c in rows])


def describe(scn: Scenario) -> str:
    dm = scn.decode_model()
    mean_len = scn.lengths.mean(50_000)
    ctx = scn.prompt_tokens + mean_len
    full = scn.slots / dm.step_s(scn.slots, scn.slots * ctx / 2)
    train_tok = scn.peak_flops * scn.train_mfu / (scn.sample_train_flops(ctx) / ctx)
    return "\n".join(
        [
            f"model {scn.params / 1e9:.1f}B ({scn.layers} layers, hidden {scn.hidden}), {scn.total_gpus} GPUs "
            f"({scn.peak_flops / 1e12:.0f} TFLOP/s, {scn.hbm_bytes_per_s / 1e12:.2f} TB/s); batch "
            f"{scn.prompts_per_step} prompts x {scn.group_size}, prompt {scn.prompt_tokens} tokens",
            f"responses: median {scn.lengths.median:.0f} x LogNormal(0,{scn.lengths.sigma_prompt}) per prompt x "
            f"LogNormal(0,{scn.lengths.sigma_sample}) per sample"
            + (
                f", {scn.lengths.long_frac:.0%} of prompts x{scn.lengths.long_factor:g}"
                if scn.lengths.long_frac
                else ""
            )
            + f", cap {scn.lengths.cap}: mean {mean_len:.0f} tokens",
            f"inference: TP{scn.tp} instances, {scn.slots} slots, KV budget {dm.kv_tokens / 1e6:.2f}M tokens; decode step "
            f"{dm.step_fixed_s * 1e3:.1f} ms + {dm.step_per_seq_s * 1e6:.1f} us/seq + {dm.step_per_ctx_token_s * 1e9:.1f} "
            f"ns/context token: {1 / dm.step_s(1, ctx):.0f} tok/s alone, {full / scn.tp:.0f} tok/s/GPU with {scn.slots} "
            f"running at mean context {ctx / 2:.0f}; prefill {1 / dm.prefill_per_token_s / scn.tp:.0f} tok/s/GPU",
            f"trainer: MFU {scn.train_mfu:.0%} x {scn.train_passes:g} passes"
            + (f" ({scn.async_train_passes:g} when s > 0)" if scn.async_train_passes is not None else "")
            + f" -> {train_tok:.0f} tok/s/GPU at length "
            f"{ctx:.0f}, +{scn.train_step_overhead_s:g} s/step; weight sync {scn.weight_sync_s:g} s; colocated switch "
            f"{scn.colocated_switch_s:g} s; stale groups: {scn.stale_policy}; partial rollouts: {scn.partial_rollouts}",
            f"simulated: 1/{scn.slice} of the cluster, {scn.token_unit}-token units, {scn.steps} steps "
            f"(measured after {scn.warmup})",
        ]
    )


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse(argv: list[str] | None = None) -> tuple[Scenario, argparse.Namespace]:
    d = Scenario()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--total-gpus", type=int, default=d.total_gpus)
    p.add_argument("--trainer-gpus", type=_ints, default=[64, 96, 128], help="comma-separated; the rest infer")
    p.add_argument("--staleness", type=_ints, default=[0, 1, 2, 4], help="max_staleness bounds, comma-separated")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated synchronous baseline")
    p.add_argument(
        "--keep",
        type=_ints,
        default=[4],
        help="staleness bounds to also run with the what-if policy that trains every admitted group",
    )
    p.add_argument("--tp", type=int, default=d.tp, help="GPUs per inference instance")
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step")
    p.add_argument("--group", type=int, default=d.group_size, help="answers per prompt (G)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--median", type=float, default=d.lengths.median, help="median response tokens")
    p.add_argument("--sigma-prompt", type=float, default=d.lengths.sigma_prompt)
    p.add_argument("--sigma-sample", type=float, default=d.lengths.sigma_sample)
    p.add_argument("--cap", type=int, default=d.lengths.cap, help="max response tokens")
    p.add_argument("--long-frac", type=float, default=0.0, help="fraction of prompts asking for longer answers")
    p.add_argument("--long-factor", type=float, default=1.0)
    p.add_argument("--params", type=float, default=d.params)
    p.add_argument("--train-mfu", type=float, default=d.train_mfu)
    p.add_argument("--train-passes", type=float, default=d.train_passes)
    p.add_argument(
        "--async-passes",
        type=float,
        default=None,
        help="train passes when s > 0 (3 = pi_old taken from the engine, as verl's fully-async)",
    )
    p.add_argument("--peak-tflops", type=float, default=d.peak_flops / 1e12, help="dense bf16 TFLOP/s per GPU")
    p.add_argument("--hbm-tbps", type=float, default=d.hbm_bytes_per_s / 1e12, help="HBM TB/s per GPU")
    p.add_argument("--hbm-gb", type=float, default=d.hbm_bytes / 1e9, help="GPU memory, GB")
    p.add_argument("--sync-s", type=float, default=d.weight_sync_s, help="weight sync seconds (engines paused)")
    p.add_argument("--colocated-switch-s", type=float, default=d.colocated_switch_s)
    p.add_argument("--stale-policy", choices=["drop", "regenerate"], default=d.stale_policy)
    p.add_argument("--no-partial", action="store_true", help="restart aborted requests instead of continuing them")
    p.add_argument("--slice", type=int, default=d.slice, help="simulate 1/slice of the cluster")
    p.add_argument("--unit", type=int, default=d.token_unit, help="real tokens per simulated token")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    a = p.parse_args(argv)
    if not 1 <= a.warmup < a.steps:
        p.error("need 1 <= --warmup < --steps")
    scn = replace(
        d,
        total_gpus=a.total_gpus,
        tp=a.tp,
        slots=a.slots,
        prompts_per_step=a.prompts,
        group_size=a.group,
        prompt_tokens=a.prompt_tokens,
        params=a.params,
        train_mfu=a.train_mfu,
        train_passes=a.train_passes,
        async_train_passes=a.async_passes,
        peak_flops=a.peak_tflops * 1e12,
        hbm_bytes_per_s=a.hbm_tbps * 1e12,
        hbm_bytes=a.hbm_gb * 1e9,
        weight_sync_s=a.sync_s,
        colocated_switch_s=a.colocated_switch_s,
        stale_policy=a.stale_policy,
        partial_rollouts=not a.no_partial,
        slice=a.slice,
        token_unit=a.unit,
        steps=a.steps,
        warmup=a.warmup,
        seed=a.seed,
        lengths=ResponseLengths(a.median, a.sigma_prompt, a.sigma_sample, a.cap, a.long_frac, a.long_factor),
    )
    return scn, a


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    scn, a = parse(argv)
    cfgs = configs(scn, a.trainer_gpus, a.staleness, colocated=not a.no_colocated, keep=a.keep)
    t0 = time.perf_counter()
    results = run_all(scn, cfgs, a.jobs)
    print(describe(scn))
    print()
    print(table(results))
    print(
        f"\n{len(cfgs)} runs in {time.perf_counter() - t0:.1f} s ({a.jobs} processes; "
        f"{sum(r['cpu_s'] for r in results):.1f} s of simulation)"
    )
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
