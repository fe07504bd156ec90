"""The parallel layouts the trainer would accept for a model, a world size and a training shape.

Each candidate is checked by `validate_sft_config`, the function `mcore-rl sft` runs before any
worker starts (its rules live in `mcore_rl.config.rules`), so the profiler never proposes a layout
the trainer refuses and never re-implements a rule. Only one thing differs from this machine: the
target cluster may have transformer-engine (context parallelism needs it), which the validation
is told through `Errors(assume_transformer_engine=...)`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal
from collections.abc import Iterator

from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rules import Errors
from mcore_rl.config.schema import ModelConfig, ParallelConfig, SFTConfig, TrainConfig
from mcore_rl.config.validate import validate_sft_config


@dataclass(frozen=True)
class TrainShape:
    """What one optimizer step trains: batch sizes in sequences, their length, numerics."""

    global_batch_size: int = 256
    micro_batch_size: int = 1
    seq_length: int = 4096
    precision: Literal["fp32", "bf16"] = "bf16"
    optimizer: str = "adamw"  # adamw | sgd
    recompute: Literal["none", "full", "selective"] = "none"
    distributed_optimizer: bool = False  # ZeRO-1: optimizer state and masters sharded over DP


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None  # None = tp
    cp: int = 1
    dp: int = 1
    sp: bool = False

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            context_parallel_size=self.cp,
            sequence_parallel=self.sp,
        )

    def name(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"vpp{self.vpp}"] if self.vpp else [])
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp is not None and self.etp != self.tp else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        return "-".join(parts + [f"dp{self.dp}"] + (["sp"] if self.sp else []))


def sft_config_for(model: ModelConfig, layout: Layout, shape: TrainShape) -> SFTConfig:
    train = TrainConfig(
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        global_batch_size=shape.global_batch_size,
        precision=shape.precision,
        recompute=shape.recompute,
    )
    return SFTConfig(model=model, parallel=layout.parallel_config(), train=train)


def check_layout(model: ModelConfig, layout: Layout, shape: TrainShape, has_transformer_engine: bool) -> None:
    """Raise the trainer's own `ConfigError` (one line per violated rule, naming the key)."""
    errors = Errors(assume_transformer_engine=has_transformer_engine)
    validate_sft_config(sft_config_for(model, layout, shape), layout.world_size, errors=errors)


def is_valid(model: ModelConfig, layout: Layout, shape: TrainShape, has_transformer_engine: bool) -> bool:
    try:
        check_layout(model, layout, shape, has_transformer_engine)
    except ConfigError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelConfig, world_size: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every factorisation of the world, before validation: TP within a node (its all-reduces are
    per layer), SP whenever TP > 1 (it only saves memory), VPP up to 4 chunks per stage, EP/ETP
    for MoE models; DP takes what is left."""
    for tp in [d for d in _divisors(world_size) if d <= gpus_per_node]:
        for pp in _divisors(world_size // tp):
            for cp in _divisors(world_size // (tp * pp)):
                dp = world_size // (tp * pp * cp)
                for vpp in [None] + ([v for v in (2, 3, 4)] if pp > 1 else []):
                    eps = _divisors(world_size // pp) if model.is_moe else [1]
                    for ep in eps:
                        for etp in [None, 1] if model.is_moe and tp > 1 else [None]:
                            yield Layout(tp, pp, vpp, ep, etp, cp, dp, sp=tp > 1)


def enumerate_layouts(
    model: ModelConfig, world_size: int, gpus_per_node: int, shape: TrainShape, has_transformer_engine: bool
) -> list[Layout]:
    return [
        lay
        for lay in candidate_layouts(model, world_size, gpus_per_node)
        if is_valid(model, lay, shape, has_transformer_engine)
    ]


_LAYOUT_KEYS = {"tp": "tp", "pp": "pp", "vpp": "vpp", "ep": "ep", "etp": "etp", "cp": "cp", "dp": "dp"}


def parse_layout(text: str, world_size: int) -> Layout:
    """`tp=2,pp=2,vpp=2,ep=4,etp=1,cp=1,sp=1` (dp defaults to what the world leaves); errors name the key."""
    values: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"([a-z]+)\s*=\s*(\w+)", item)
        if not m or m.group(1) not in list(_LAYOUT_KEYS) + ["sp"]:
            raise ConfigError(
                f"--layout: cannot read {item!r}; write key=value with keys {', '.join(list(_LAYOUT_KEYS) + ['sp'])}"
            )
        key, value = m.groups()
        if key == "sp":
            values["sp"] = value.lower() in ("1", "true", "yes")
            continue
        if not value.isdigit():
            raise ConfigError(f"--layout: {key} must be a whole number, got {value!r}")
        values[key] = int(value)
    tp, pp, cp = values.get("tp", 1), values.get("pp", 1), values.get("cp", 1)
    if min(tp, pp, cp) < 1:
        raise ConfigError(f"--layout: tp, pp and cp must be >= 1, got tp={tp} pp={pp} cp={cp}")
    dp = values.get("dp", world_size // (tp * pp * cp) if world_size % (tp * pp * cp) == 0 else 0)
    if dp * tp * pp * cp != world_size:
        raise ConfigError(
            f"--layout: tp ({tp}) x pp ({pp}) x cp ({cp}) x dp ({dp}) = {tp * pp * cp * dp} "
            f"is not the cluster's {world_size} GPUs"
        )
    lay = Layout(tp, pp, values.get("vpp"), values.get("ep", 1), values.get("etp"), cp, dp, sp=values.get("sp", tp > 1))
    return lay


def replace(layout: Layout, **changes) -> Layout:
    return dataclasses.replace(layout, **changes)
