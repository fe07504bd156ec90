"""A training checkpoint's Hugging Face provenance, carried from the checkpoint it started from.

`mcore-rl convert hf-to-mcore` records the source's HF config (special-token ids, the user's key
spellings), its dtype and its path in the checkpoint's common state, and copies its tokenizer and
generation files to `<output>/hf_assets/`. The export (`convert/to_hf.py`) reads exactly those. A
run that starts from such a checkpoint (`mcore-rl sft`, `mcore-rl train`) keeps them: it reads them
when it loads (`read_provenance`) and writes them into every checkpoint it saves
(`carry_provenance`), so an export of an SFT'd or RL'd checkpoint keeps the dtype, the special ids
(null stays null) and the tokenizer files without extra flags, however many runs lie in between.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

# The common-state keys the converter writes (convert/to_mcore.py) and the exporter reads.
PROVENANCE_KEYS = ("hf_config", "hf_dtype", "hf_source")
# The assets folder next to a checkpoint's `latest` file: the name convert.hf_checkpoint.ASSETS_DIR gives it.
ASSETS_DIR = "hf_assets"
_ASSETS_FROM = "hf_assets_from"  # where the loaded checkpoint's assets are (not stored)


def checkpoint_save_dir(path: str) -> str:
    """The save dir of a checkpoint path (`<save_dir>/iter_*`; a bare checkpoint dir is its own)."""
    from mcore_rl.train.checkpoint import LATEST  # lazy: torch

    parent = os.path.dirname(os.path.abspath(path))
    return parent if os.path.exists(os.path.join(parent, LATEST)) else os.path.abspath(path)


def read_provenance(common: dict[str, Any], path: str) -> dict[str, Any]:
    """The provenance of the checkpoint at `path` whose common state is `common` (empty if none)."""
    out = {k: common[k] for k in PROVENANCE_KEYS if k in common}
    assets = os.path.join(checkpoint_save_dir(path), ASSETS_DIR)
    if os.path.isdir(assets):
        out[_ASSETS_FROM] = assets
    return out


def carry_provenance(provenance: dict[str, Any], common: dict[str, Any], save_dir: str) -> dict[str, Any]:
    """`common` plus the provenance keys; on global rank 0 the assets are copied to
    `<save_dir>/hf_assets/` (call before the collective save, which orders it with its barriers)."""
    import torch.distributed as dist

    out = dict(common, **{k: provenance[k] for k in PROVENANCE_KEYS if k in provenance})
    source = provenance.get(_ASSETS_FROM)
    target = os.path.join(os.path.abspath(save_dir), ASSETS_DIR)
    if source and os.path.abspath(source) != target and (not dist.is_initialized() or dist.get_rank() == 0):
        shutil.copytree(source, target, dirs_exist_ok=True)
    return out
