"""The inference engines the rollout manager talks to: embedded `EngineCore`s in this process, or
SGLang-compatible HTTP servers (`sglang.launch_server`, `mcore-rl serve`) behind `EngineRouter`.

Both take the same requests (token ids + SGLang sampling parameters, with log-probs) and return
the same `Generation`s, and both hand the weight sync its transport: in-process for embedded
engines, the configured HTTP transport (shared-memory tensors, disk, or SGLang's broadcast group)
for servers. Only global rank 0 ever holds engines.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mcore_rl.config.schema import ModelConfig


@dataclass
class GenRequest:
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SGLang names: temperature, max_new_tokens, sampling_seed, ...
    rid: str = ""


@dataclass
class Generation:
    output_ids: list[int]
    output_logprobs: list[float]  # μ per output token
    weight_version: int
    finish_reason: str  # "stop" | "length" | "abort"
    text: str
    engine: str


class EmbeddedEngines:
    """`EngineCore`s in this process, stepped in turn until every request has finished."""

    def __init__(self, cores: Sequence[Any]) -> None:
        self.cores = list(cores)

    @classmethod
    def build(cls, mc: ModelConfig, tokenizer: Any, *, num: int, quantization: str,
              max_running_requests: int, context_length: int, seed: int) -> "EmbeddedEngines":
        """`num` engines holding an (uninitialised) reference model of `mc`; the first weight sync
        fills them. `quantization`: "fp8" (e4m3 block weights), "bf16" or "none" (fp32).

        The engines report log-probs of the temperature-scaled distribution they sample from
        (SGLang's default, `return_original_logprob=False`), and the learner recomputes π at the
        same temperature, so μ and π are the same function of the logits."""
        from mcore_rl.hf import Qwen3ReferenceForCausalLM, hf_config_from_model_config
        from mcore_rl.rollout.engine.core import EngineCore

        cores = []
        for i in range(num):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + i)
                model = Qwen3ReferenceForCausalLM(hf_config_from_model_config(mc))
            cores.append(EngineCore(
                model, tokenizer, max_running_requests=max_running_requests, context_length=context_length,
                quantization="fp8" if quantization == "fp8" else None,
                dtype="bfloat16" if quantization == "bf16" else "float32", random_seed=seed + i,
                return_original_logprob=False,
                device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None,
            ))
        return cls(cores)

    @property
    def weight_version(self) -> int:
        return self.cores[0].weight_version

    def transport(self, cfg: Any) -> Any:
        from mcore_rl.rollout.weight_sync import InProcessTransport

        return InProcessTransport(self.cores)

    def generate(self, requests: Sequence[GenRequest]) -> list[Generation]:
        from mcore_rl.rollout.engine.core import Request
        from mcore_rl.rollout.engine.sampling import SamplingParams

        rids = [r.rid or uuid.uuid4().hex for r in requests]
        where: dict[str, int] = {}
        for i, (req, rid) in enumerate(zip(requests, rids)):
            self.cores[i % len(self.cores)].add_request(
                Request(rid, list(req.input_ids), SamplingParams(**req.sampling_params), return_logprob=True)
            )
            where[rid] = i
        results: list[Optional[Generation]] = [None] * len(requests)
        pending = len(requests)
        while pending:
            progressed = False
            for j, core in enumerate(self.cores):
                if not core.has_work():
                    continue
                progressed = True
                for out in core.step():
                    if not out.finished or out.rid not in where:
                        continue
                    results[where[out.rid]] = Generation(
                        list(out.output_ids), [lp for lp, _ in out.output_token_logprobs], int(out.weight_version),
                        (out.finish_reason or {}).get("type", "abort"), out.text or "", f"embedded:{j}",
                    )
                    pending -= 1
            if not progressed:
                raise RuntimeError(f"embedded engines went idle with {pending} requests unfinished")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        pass


class RemoteEngines:
    """SGLang-compatible servers, called through `EngineRouter` from a private event-loop thread
    (the trainer is synchronous). Requests carry rids, so a failover never runs one twice."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 600.0, concurrency: int = 512) -> None:
        from mcore_rl.rollout.router import EngineRouter

        self.urls = [u.rstrip("/") for u in urls]
        self.concurrency = concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-http", daemon=True)
        self._thread.start()
        self.router = self._run(self._make_router(EngineRouter, timeout))
        self._transport: Any = None

    async def _make_router(self, cls: Any, timeout: float) -> Any:
        router = cls(self.urls, timeout=timeout)
        router.start()
        return router

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def weight_version(self) -> int:
        async def get() -> int:
            client = next(iter(self.router.clients.values()))
            return int(await client.get_weight_version())

        return self._run(get())

    def transport(self, cfg: Any) -> Any:
        """The weight transport `rollout.sync_transport` names, to every engine URL."""
        from mcore_rl.rollout.weight_sync import DiskTransport, DistributedTransport, TensorTransport

        r = cfg.rollout
        if r.sync_transport == "tensor":
            self._transport = TensorTransport(self.urls)
        elif r.sync_transport == "disk":
            self._transport = DiskTransport(self.urls, r.sync_dir)
        else:
            self._transport = DistributedTransport(self.urls)
        return self._transport

    def generate(self, requests: Sequence[GenRequest]) -> list[Generation]:
        return self._run(self._generate(requests))

    async def _generate(self, requests: Sequence[GenRequest]) -> list[Generation]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(req: GenRequest) -> Generation:
            async with sem:
                out = await self.router.generate(
                    input_ids=list(req.input_ids), sampling_params=dict(req.sampling_params),
                    return_logprob=True, rid=req.rid or uuid.uuid4().hex,
                )
            meta = out["meta_info"]
            return Generation(
                list(out["output_ids"]), [float(t[0]) for t in meta.get("output_token_logprobs", [])],
                int(meta.get("weight_version", 0)), (meta.get("finish_reason") or {}).get("type", "abort"),
                out.get("text", ""), "remote",
            )

        return list(await asyncio.gather(*(one(r) for r in requests)))

    def close(self) -> None:
        if self._transport is not None and hasattr(self._transport, "close"):
            self._transport.close()
        if not self._loop.is_closed():
            self._run(self.router.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
