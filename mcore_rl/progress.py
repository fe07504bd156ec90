"""Progress bars for long operations (conversion, checkpoints, warm start, evaluation, the run).

One place decides who draws: only global rank 0 (or a process outside a distributed job) shows a
bar, so a world of N ranks prints one bar, not N. `MCORE_RL_PROGRESS=0` turns every bar off (CI
logs, scripts); the bars write to stderr, so stdout stays parseable (`--json` output).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def bars_enabled(enabled: bool = True) -> bool:
    return enabled and os.environ.get("MCORE_RL_PROGRESS", "1") != "0" and is_rank0()


def progress(total: float | None, desc: str, unit: str = "it", enabled: bool = True, **kwargs: Any) -> Any:
    """A tqdm bar on rank 0; a disabled one (same methods, draws nothing) elsewhere. With
    `unit="B"` it shows bytes/s in binary units."""
    from tqdm import tqdm

    if unit == "B":
        kwargs.setdefault("unit_scale", True)
        kwargs.setdefault("unit_divisor", 1024)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        dynamic_ncols=True,
        file=sys.stderr,
        disable=not bars_enabled(enabled),
        **kwargs,
    )


def log_line(message: str) -> None:
    """Print a line on rank 0 without breaking a bar that is being drawn."""
    if is_rank0():
        from tqdm import tqdm

        tqdm.write(message)
