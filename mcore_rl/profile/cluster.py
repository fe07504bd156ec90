"""The cluster a layout is estimated for: nodes of GPUs with memory, peak rates and links.

A description is a YAML mapping (or one of the presets below, by name). Every field is required
and checked, so a missing or impossible value fails with the key that holds it, before anything
is estimated. Rates are per GPU; bandwidths are per GPU and per direction (what one rank can push
into a collective), latencies per message hop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import yaml

from mcore_rl.config.errors import ConfigError


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float  # usable device memory per GPU, GiB
    peak_tflops_bf16: float  # dense matmul peak per GPU, TFLOP/s
    peak_tflops_fp32: float
    memory_bandwidth_gbps: float  # device memory (HBM) bandwidth, GB/s: decode is bound by it
    intra_node_bandwidth_gbps: float  # per-GPU bandwidth inside a node (NVLink), GB/s
    inter_node_bandwidth_gbps: float  # per-GPU bandwidth between nodes (IB/RoCE), GB/s
    intra_node_latency_us: float
    inter_node_latency_us: float
    compute_efficiency: float  # achieved / peak matmul rate assumed for the step-time estimate
    has_transformer_engine: bool  # the target runs megatron-core's TE spec (CP needs it)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def peak_flops(self, precision: str) -> float:
        return 1e12 * (self.peak_tflops_bf16 if precision == "bf16" else self.peak_tflops_fp32)

    def link(self, group_size: int, stride: int) -> tuple[float, float]:
        """(bytes/s, latency s) of a collective over `group_size` ranks `stride` apart: inside a
        node if the whole group fits in one (ranks are laid out TP fastest, as megatron does)."""
        if group_size * stride <= self.gpus_per_node:
            return self.intra_node_bandwidth_gbps * 1e9, self.intra_node_latency_us * 1e-6
        return self.inter_node_bandwidth_gbps * 1e9, self.inter_node_latency_us * 1e-6


# H100 SXM: 989 dense bf16 TFLOP/s, 3.35 TB/s HBM3, NVLink 4 (450 GB/s per direction), one
# 400 Gb/s NIC per GPU (50 GB/s). H200 differs in memory (141 GB, 4.8 TB/s). 80 GB cards leave
# ~76 GiB to the trainer after the CUDA context and NCCL buffers. The efficiencies are stated
# assumptions (what well-tuned megatron runs report at these sizes), not fitted to anything here.
PRESETS: dict[str, dict[str, Any]] = {
    "h100_sxm": dict(
        nodes=8,
        gpus_per_node=8,
        gpu_memory_gb=76.0,
        peak_tflops_bf16=989.0,
        peak_tflops_fp32=67.0,
        memory_bandwidth_gbps=3350.0,
        intra_node_bandwidth_gbps=450.0,
        inter_node_bandwidth_gbps=50.0,
        intra_node_latency_us=5.0,
        inter_node_latency_us=10.0,
        compute_efficiency=0.5,
        has_transformer_engine=True,
    ),
    "h200": dict(
        nodes=8,
        gpus_per_node=8,
        gpu_memory_gb=135.0,
        peak_tflops_bf16=989.0,
        peak_tflops_fp32=67.0,
        memory_bandwidth_gbps=4800.0,
        intra_node_bandwidth_gbps=450.0,
        inter_node_bandwidth_gbps=50.0,
        intra_node_latency_us=5.0,
        inter_node_latency_us=10.0,
        compute_efficiency=0.5,
        has_transformer_engine=True,
    ),
    # this machine as a 4-rank gloo "cluster"; peak_tflops_* is replaced by a measured matmul rate
    # (`measure.calibrate_cpu`) when `--measure` runs, the number here is only a placeholder
    "cpu_here": dict(
        nodes=1,
        gpus_per_node=4,
        gpu_memory_gb=8.0,
        peak_tflops_bf16=0.02,
        peak_tflops_fp32=0.05,
        memory_bandwidth_gbps=10.0,
        intra_node_bandwidth_gbps=2.0,
        inter_node_bandwidth_gbps=1.0,
        intra_node_latency_us=50.0,
        inter_node_latency_us=100.0,
        compute_efficiency=1.0,
        has_transformer_engine=False,
    ),
}

_POSITIVE = (
    "nodes",
    "gpus_per_node",
    "gpu_memory_gb",
    "peak_tflops_bf16",
    "peak_tflops_fp32",
    "memory_bandwidth_gbps",
    "intra_node_bandwidth_gbps",
    "inter_node_bandwidth_gbps",
)


def cluster_from_dict(raw: Any, name: str, where: str = "cluster") -> ClusterSpec:
    """Check every field (all problems at once, each as `where.key: problem`) and build the spec."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping of cluster fields, got {type(raw).__name__}")
    names = [f.name for f in fields(ClusterSpec) if f.name != "name"]
    problems = [f"{where}.{k}: unknown field (known: {', '.join(names)})" for k in raw if k not in names]
    problems += [f"{where}.{k}: missing" for k in names if k not in raw]
    values: dict[str, Any] = {}
    for key in names:
        if key not in raw:
            continue
        value = raw[key]
        if key == "has_transformer_engine":
            if not isinstance(value, bool):
                problems.append(f"{where}.{key}: must be true or false, got {value!r}")
            values[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}.{key}: must be a number, got {value!r}")
            continue
        if key in ("nodes", "gpus_per_node") and int(value) != value:
            problems.append(f"{where}.{key}: must be a whole number, got {value!r}")
        if key in _POSITIVE and value <= 0:
            problems.append(f"{where}.{key}: must be > 0, got {value!r}")
        if key.endswith("latency_us") and value < 0:
            problems.append(f"{where}.{key}: must be >= 0, got {value!r}")
        if key == "compute_efficiency" and not 0 < value <= 1:
            problems.append(f"{where}.{key}: must be in (0, 1], got {value!r}")
        values[key] = int(value) if key in ("nodes", "gpus_per_node") else float(value)
    if problems:
        raise ConfigError("invalid cluster description:\n  " + "\n  ".join(problems))
    return ClusterSpec(name=name, **values)


def load_cluster(source: str, overrides: dict[str, Any] | None = None) -> ClusterSpec:
    """A preset name (`h100_sxm`, `h200`, `cpu_here`) or a YAML file, with fields overridden
    (e.g. `nodes` from `--nodes`)."""
    if source in PRESETS:
        raw, name, where = dict(PRESETS[source]), source, f"cluster {source}"
    elif os.path.isfile(source):
        with open(source) as f:
            raw = yaml.safe_load(f)
        name, where = os.path.splitext(os.path.basename(source))[0], source
        if isinstance(raw, dict) and isinstance(raw.get("cluster"), dict):
            raw = raw["cluster"]
    else:
        raise ConfigError(f"--cluster: {source!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    if isinstance(raw, dict):
        raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return cluster_from_dict(raw, name, where)
