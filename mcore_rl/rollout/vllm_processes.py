"""vLLM servers as processes the trainer starts and owns (docs/serving.md#vllm-engines).

The same life as `EngineProcesses` (started, waited for on `/health`, killed with every child
when the run ends or the trainer dies, restarted at the same URL by the pool's restarter), but the
command is `python -m vllm.entrypoints.openai.api_server` from vLLM's own venv (it pins its own
torch, so it never shares the trainer's): `tools/setup_vllm.sh` creates it, at
`$MCORE_RL_VLLM_VENV` or `.vllm-venv` at the repository root (`rollout.vllm_python` names another
interpreter).

The flags are the ones that make vLLM an RL engine on CPU: `VLLM_SERVER_DEV_MODE=1` opens the
pause, weight and `/collective_rpc` routes; `--enforce-eager` (startup about 35 s instead of
minutes of compilation); `--skip-tokenizer-init` (token ids in and out; the trainer decodes);
`--logprobs-mode processed_logprobs` (log-probs after temperature, what the learner recomputes;
the validation refuses top-p/top-k, after which "processed" would also mean renormalised).

vLLM cannot start with dummy weights and reload them later (its dummy loader has no
`get_all_weights`), so the model directory holds real ones: the trainer's model, initialised
from `seed` as the embedded engines are, written as a stock HF checkpoint; the first weight sync
replaces them, as it does for `mcore-rl serve --load-format dummy`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from mcore_rl.config.rl_vllm import VLLM_SETUP, VLLM_VENV_ENV, vllm_python
from mcore_rl.config.schema import ModelConfig
from mcore_rl.parallel.lifetime import session_members
from mcore_rl.rollout.engine_processes import EngineProcesses, EngineStartError, _child_env, _Engine

SERVED_MODEL_NAME = "policy"


class VLLMEngineProcesses(EngineProcesses):
    """`num` vLLM servers on this host; `.urls` for `HTTPEnginePool` with `VLLMEngineClient`s."""

    def __init__(
        self, engines: list[_Engine], host: str, model_dir: str, startup_timeout_s: float, python: str
    ) -> None:
        super().__init__(engines, host, model_dir, startup_timeout_s)
        self.python = python

    @classmethod
    def start_vllm(
        cls,
        model_config: ModelConfig | None,
        *,
        num: int,
        workdir: str,
        python: str | None = None,
        dtype: str = "float32",
        max_running_requests: int = 256,
        context_length: int = 1024,
        seed: int = 0,
        cores: Sequence[Sequence[int]] | None = None,
        threads: int | None = None,
        kv_cache_gib: int = 1,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        model_path: str | None = None,
    ) -> VLLMEngineProcesses:
        """Start `num` vLLM servers of `model_config` (or of the HF checkpoint `model_path`) and
        return once each answers `/health`. dtype: "float32" | "bfloat16"; kv_cache_gib: each
        engine's KV cache (`VLLM_CPU_KVCACHE_SPACE`). Logs go to `workdir/engine_{i}.log`. Raises
        `EngineStartError` (after stopping what it started) if the venv is missing, or an engine
        exits or stays silent for `startup_timeout_s`."""
        if num < 1:
            raise ValueError(f"num: need at least one engine, got {num}")
        if cores is not None and len(cores) != num:
            raise ValueError(f"cores: one entry per engine expected ({num}), got {len(cores)}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: {dtype!r} is not float32 or bfloat16")
        exe = vllm_python(python)
        if not os.path.exists(exe):
            raise EngineStartError(
                f"rollout.vllm_python: no vLLM interpreter at {exe}; create the venv with `bash {VLLM_SETUP}` "
                f"(or set ${VLLM_VENV_ENV} or rollout.vllm_python)"
            )
        os.makedirs(workdir, exist_ok=True)
        if model_path is not None:
            model_dir = os.path.abspath(model_path)
        elif model_config is not None:
            model_dir = write_vllm_model_dir(model_config, os.path.join(workdir, "model"), seed)
            # vLLM refuses a context longer than the model's positions (SGLang's servers cap it themselves)
            context_length = min(context_length, model_config.max_position_embeddings)
        else:
            raise ValueError("model_config / model_path: give one of them")
        common = [
            "--model",
            model_dir,
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--dtype",
            dtype,
            "--enforce-eager",
            "--skip-tokenizer-init",
            "--logprobs-mode",
            "processed_logprobs",
            "--max-model-len",
            str(context_length),
            "--max-num-seqs",
            str(max_running_requests),
            # vllm-cpu 0.32 kills its EngineCore when a seeded request's prompt is cut over two steps (chunked
            # prefill, past its 2048 batched tokens: "CPU Generator does not use offset"); a prompt that does
            # not fit waits for the next step instead (so a step must hold the longest one, and every running one)
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(2048, context_length, max_running_requests)),
        ]
        common += ["--api-key", api_key] if api_key else []
        engines = []
        for i in range(num):
            env = vllm_env(threads, kv_cache_gib)
            engines.append(
                _Engine(
                    i,
                    0,
                    [*common, "--seed", str(seed + i), *extra_args],
                    env,
                    list(cores[i]) if cores is not None else None,
                    os.path.join(workdir, f"engine_{i}.log"),
                )
            )
        procs = cls(engines, host, model_dir, startup_timeout_s, exe)
        procs._start_all()
        return procs

    def _ready(self, e: _Engine) -> None:
        super()._ready(e)
        if e.proc is not None:
            split_two_cores(e.proc.pid)

    def _argv(self, e: _Engine) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            self.host,
            "--port",
            str(e.port),
            *e.argv_tail,
        ]


def split_two_cores(leader: int) -> bool:
    """On two cores, give the API server (`leader`) one core and the rest of its session (vLLM's
    EngineCore, its worker, the resource tracker) the other; True if it did. Elsewhere nothing.

    Why: vLLM's CPU build binds its one worker to the first core and leaves the second to the
    EngineCore and the API server, but the EngineCore busy-waits (`sched_yield` in a loop, for a
    second after each message) on the worker's replies for as long as a generation runs, and on an
    otherwise idle machine the API server then answered nothing until the generation ended:
    `/metrics`, `/pause` or `/abort_requests` waited as long as a 1200-token request took, so a
    request could not be paused or aborted mid-flight. With one worker thread there is no OpenMP
    team to disturb, so the EngineCore waits beside the worker (the two take turns) and the
    server keeps a core of its own (docs/serving.md#vllm-engines, measured there)."""
    try:
        cores = sorted(os.sched_getaffinity(leader))
    except OSError:
        return False
    if len(cores) != 2:
        return False
    for pid in session_members(leader):
        _pin_threads(pid, cores[1:] if pid == leader else cores[:1])
    return True


def _pin_threads(pid: int, cores: list[int]) -> None:
    """Every thread of `pid` (affinity is per thread; threads started later inherit it)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass  # gone meanwhile


def vllm_env(threads: int | None, kv_cache_gib: int) -> dict[str, str]:
    """The environment of a vLLM server: the RL routes on, its own venv's packages only."""
    env = _child_env(threads)
    env.pop("PYTHONPATH", None)  # vLLM imports from its own venv, never the trainer's mcore_rl or torch
    env.pop("VIRTUAL_ENV", None)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, /update_weight_version
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def write_vllm_model_dir(model_config: ModelConfig, path: str, seed: int) -> str:
    """A stock HF checkpoint of `model_config` (config.json and weights initialised from `seed`)
    that vLLM can serve; returns its absolute path. Raises `ValueError` for a model with no stock
    transformers class (vLLM has no remote-code path for ours)."""
    from safetensors.torch import save_file  # lazy: only the vLLM backend writes weights here

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config  # lazy: transformers
    from mcore_rl.hf.configuration import to_stock_hf_config  # lazy: transformers
    from mcore_rl.hf.families import stock_decoder  # lazy: transformers

    ours = hf_config_from_model_config(model_config)
    try:
        stock = to_stock_hf_config(ours)
    except ValueError as err:
        raise ValueError(f"rollout.engine_kind: vllm serves stock transformers models only; {err}") from err
    decoder = stock_decoder(stock.model_type)
    if decoder is None:
        raise ValueError(f"rollout.engine_kind: vllm serves stock transformers models only, not {stock.model_type!r}")
    stock.architectures = [decoder.stock_class]
    os.makedirs(path, exist_ok=True)
    stock.save_pretrained(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = McoreRLForCausalLM(ours).float()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))
    return os.path.abspath(path)
