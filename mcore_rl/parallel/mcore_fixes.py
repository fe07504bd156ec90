"""Fixes to megatron-core 0.16.1 bugs that hold on every device, not only on CPU.

`cpu_compat` makes megatron-core run without CUDA; this module is for what is wrong with CUDA
too. Found by the GPU check on an H200 without transformer-engine: the MoE router's gating
function tests `te_general_gemm is not None`, a name `moe_utils` only binds when transformer-engine
imports, so every MoE forward without transformer-engine raised NameError. Binding it to None takes
megatron-core's own torch path (`torch.mm`/`addmm` in the router dtype).
"""

from __future__ import annotations


def apply() -> None:
    """Idempotent; cheap after the first call."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # a name megatron-core binds only when transformer-engine imports
