"""Layers a checkpoint holds beyond the model's decoder layers, carried through conversion unchanged.

DeepSeek-V3 and DeepSeek-R1 ship their multi-token-prediction module as extra layers after the last
decoder layer (`model.layers.{num_hidden_layers + i}.*`, i < `num_nextn_predict_layers`: an
embedding norm, a hidden norm, `eh_proj`, one decoder layer and a shared head), which stock
`transformers` skips on load. The trainer does not build or train them, but an export must not lose
them (serving engines use them for speculative decoding): `hf-to-mcore` copies them, dequantized like
every weight (`convert/fp8.py`), into `<output>/hf_carried/`, and `mcore-to-hf` writes them back
after the model's own tensors. They are the source's values: stale once the model has trained.
"""

from __future__ import annotations

import os
import re

from mcore_rl.convert.hf_checkpoint import HFCheckpoint
from mcore_rl.convert.stream_export import SafetensorsShardWriter, natural_key

CARRIED_DIR = "hf_carried"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def carried_names(source: HFCheckpoint, num_layers: int) -> list[str]:
    """The source's tensors of layers past the model's `num_layers`, in natural order."""
    names = [n for n in source if (m := _LAYER.match(n)) and int(m.group(1)) >= num_layers]
    return sorted(names, key=natural_key)


def save_carried(source: HFCheckpoint, names: list[str], output_dir: str, max_shard_bytes: int) -> str | None:
    """Write `names` of `source` into `output_dir/hf_carried/` one tensor at a time; its path, None if none."""
    if not names:
        return None
    target = os.path.join(output_dir, CARRIED_DIR)
    os.makedirs(target, exist_ok=True)
    plan = [(n, tuple(source.meta(n).shape), source.meta(n).dtype) for n in names]
    writer = SafetensorsShardWriter(target, plan, max_shard_bytes)
    for name in names:
        writer.write(name, source[name])
    writer.close()
    return target


def open_carried(save_dir: str) -> HFCheckpoint | None:
    """The carried tensors of a converted checkpoint's save dir, None if it has none."""
    path = os.path.join(save_dir, CARRIED_DIR)
    return HFCheckpoint(path) if os.path.isdir(path) else None
