"""Tokens/s and MFU per device from the model config (FLOPs: `models/flops.py`, the one count).

MFU's denominator is one device's peak FLOP/s at the training precision: `logging.peak_flops_per_device`
when set, else the vendor's dense (no sparsity) figure for the CUDA device's kind, else, on CPU, a
measured one: the rate of a 1024x1024 fp32 matmul in this process (torch's thread count), which is
what the CPU can reach, not a datasheet figure. The metrics say which (`perf/peak_measured` = 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.models.flops import mfu, train_flops_per_token

# dense peak FLOP/s per device kind (name substring, as torch.cuda.get_device_name reports it)
CUDA_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp32": 494.7e12},  # fp32 = TF32 tensor cores
    "H100 PCIe": {"bf16": 756.5e12, "fp32": 378.0e12},
    "H100": {"bf16": 989.4e12, "fp32": 494.7e12},
    "H800": {"bf16": 989.4e12, "fp32": 494.7e12},
    "B200": {"bf16": 2250e12, "fp32": 1100e12},
    "A100": {"bf16": 312e12, "fp32": 156e12},
    "A800": {"bf16": 312e12, "fp32": 156e12},
    "L40S": {"bf16": 362e12, "fp32": 183e12},
    "A10": {"bf16": 125e12, "fp32": 62.5e12},
    "RTX 4090": {"bf16": 165e12, "fp32": 82.6e12},
}

_measured_cpu: float | None = None


def measure_cpu_peak(size: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of a square fp32 matmul on this process's CPU threads (measured once per process)."""
    global _measured_cpu
    if _measured_cpu is None:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.mm(a, b)
            n += 1
        _measured_cpu = 2.0 * size**3 * n / (time.perf_counter() - start)
    return _measured_cpu


def device_peak_flops(configured: float, precision: str) -> tuple[float, bool]:
    """(peak FLOP/s of one device, whether it was measured rather than configured or looked up)."""
    if configured > 0:
        return configured, False
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for kind, peaks in CUDA_PEAK_FLOPS.items():
            if kind in name:
                return peaks["bf16" if precision == "bf16" else "fp32"], False
        raise ValueError(f"no peak FLOP/s known for CUDA device {name!r}: set logging.peak_flops_per_device")
    return measure_cpu_peak(), True


@dataclass
class Throughput:
    """What one run's steps compute per token and the devices' peak, for `perf/*` metrics."""

    flops_per_token: float
    peak_flops_per_device: float
    peak_measured: bool
    world_size: int

    @classmethod
    def for_run(
        cls, model: Any, seq_length: int, recompute: str, precision: str, configured_peak: float, world_size: int
    ) -> Throughput:
        peak, measured = device_peak_flops(configured_peak, precision)
        return cls(train_flops_per_token(model, seq_length, recompute), peak, measured, world_size)

    def metrics(self, tokens: float, seconds: float) -> dict[str, float]:
        """`tokens` trained (forward + backward + optimizer) in `seconds`, over all devices."""
        per_device = tokens / max(seconds, 1e-12) / self.world_size
        return {
            "perf/train_tokens": float(tokens),
            "perf/tokens_per_s_per_device": per_device,
            "perf/mfu": mfu(per_device, self.flops_per_token, self.peak_flops_per_device),
            "perf/peak_flops_per_device": self.peak_flops_per_device,
            "perf/peak_measured": float(self.peak_measured),
        }

    def describe(self) -> str:
        how = "measured (fp32 matmul on this CPU)" if self.peak_measured else "configured or by device kind"
        return (
            f"MFU against {self.peak_flops_per_device / 1e12:.3g} TFLOP/s per device ({how}); "
            f"{self.flops_per_token / 1e6:.3g} MFLOPs per trained token"
        )
