"""The engine pool: the one place that holds the inference engines (docs/design.md#engines-are-processes).

Two kinds, one interface: `EmbeddedEnginePool` (`EngineCore`s in this process) and
`HTTPEnginePool` (SGLang-compatible servers: `sglang.launch_server`, `mcore-rl serve`). Both take
the same requests (token ids + SGLang sampling parameters, with log-probs), return the same
`Generation`s, and hand the weight sync its transport: in-process for embedded engines, the
configured HTTP transport (shared-memory tensors, disk, or SGLang's broadcast group) for servers.
The HTTP pool routes generation through `EngineRouter` (least outstanding requests, health,
failover) and fans control and weight-update calls out to every engine from one event-loop
thread, so the synchronous trainer can call all engines at once. Only global rank 0 holds a pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from mcore_rl.config.rl_schema import RolloutConfig
from mcore_rl.config.schema import ModelConfig
from mcore_rl.rollout.weight_transports import (
    DiskTransport,
    DistributedTransport,
    InProcessTransport,
    TensorTransport,
    Transport,
)
from mcore_rl.config.rl_validate import started_engines
from mcore_rl.rollout.engine_processes import EngineProcesses
from mcore_rl.rollout.weight_protocol import checksum_problem

if TYPE_CHECKING:  # annotations only (the engine processes module: loaded when the trainer starts some)
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from mcore_rl.rollout.engine_processes import EngineProcesses
    from mcore_rl.rollout.weight_protocol import WeightChecksum

logger = logging.getLogger(__name__)


@dataclass
class GenRequest:
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SGLang names: temperature, max_new_tokens, sampling_seed, ...
    rid: str = ""
    # routing replay (R3): ask for SGLang's return_routed_experts
    return_routed_experts: bool = False
    return_sampling_mask: bool = False  # sampling-mask replay: ask for the support of every output token
    # prompt scoring: the log-probs of input_ids[start + 1:] (SGLang's logprob_start_len); None = not asked for
    logprob_start_len: int | None = None


@dataclass
class Generation:
    output_ids: list[int]
    output_logprobs: list[float]  # μ per output token
    weight_version: int
    finish_reason: str  # "stop" | "length" | "abort"
    text: str
    engine: str
    # weight version of each output token, when the engine reports it (`mcore-rl serve`'s
    # meta_info `output_token_weight_versions`); None = all from `weight_version`
    output_versions: list[int] | None = None
    # routing replay (R3), with GenRequest.return_routed_experts: numpy int32 [len(input_ids) +
    # len(output_ids) - 1, num_layers, topk], the experts of every forwarded token (-1: dense layer)
    routed_experts: Any = None
    # sampling-mask replay (with GenRequest.return_sampling_mask; SGLang's meta_info
    # output_token_sampling_mask / output_token_sampling_logprobs): per output token the ids of the
    # support it was drawn from, and its log-prob under the renormalised post-filter weights
    output_sampling_masks: list[list[int]] | None = None
    output_sampling_logprobs: list[float] | None = None
    # with GenRequest.logprob_start_len = s: the log-prob of each of input_ids[s + 1:] given the ones before
    input_logprobs: list[float] | None = None


class EnginePool(Protocol):
    """What the rollout manager and the weight sync need of the engines."""

    def generate(self, requests: Sequence[GenRequest], on_done: Callable[[], None] | None = None) -> list[Generation]:
        """The generations of `requests`, in order; `on_done()` after each one finishes (progress)."""
        ...

    async def agenerate(self, req: GenRequest) -> Generation:
        """One request from the pool's event loop (`PoolLoop`): the scheduler's and the agents' call."""
        ...

    def weight_transport(self, rollout: RolloutConfig) -> Transport: ...

    @property
    def weight_version(self) -> int: ...

    def close(self) -> None: ...


def expected_logprobs_mode(rollout: RolloutConfig) -> str:
    """The engines' `logprobs_mode` the trainer expects: "processed" with sampling-mask replay (μ is
    then the log-prob under the distribution the token was drawn from), else "raw"."""
    return "processed" if rollout.sampling_mask_replay else "raw"


def check_logprobs_mode(pool: HTTPEnginePool, rollout: RolloutConfig) -> None:
    """Refuse engines whose `/get_server_info` reports `logprobs_mode: processed` when the trainer
    does not replay the sampling mask (μ would be a renormalised log-prob that π never is). An
    engine that does not report the mode (a real SGLang server), or has no `/get_server_info`, is
    taken as "raw"."""
    if rollout.sampling_mask_replay:
        return  # μ comes from output_token_sampling_logprobs, whatever output_token_logprobs are
    replies = pool._settle(pool.start("get_server_info", {}), "/get_server_info")
    for url, (info, err) in replies.items():  # an engine without the endpoint (an error) reports no mode
        mode = info.get("logprobs_mode", "raw") if err is None and isinstance(info, dict) else "raw"
        if mode != "raw":
            raise ValueError(
                f"rollout.sampling_mask_replay: engine {url} reports logprobs_mode={mode!r}, whose "
                "output_token_logprobs are renormalised over the sampling mask; with sampling_mask_replay false "
                "the trainer needs raw log-probs (start it with --logprobs-mode raw, or set "
                "rollout.sampling_mask_replay: true)"
            )


class EngineTimeouts(TypedDict):
    control_timeout: float
    weight_update_timeout: float
    no_engine_timeout_s: float


def engine_timeouts(rollout: RolloutConfig) -> EngineTimeouts:
    """`HTTPEnginePool`'s timeouts besides generation's, from the rollout config (never longer
    than a generation request's)."""
    return {
        "control_timeout": min(rollout.control_timeout_s, rollout.request_timeout_s),
        "weight_update_timeout": min(rollout.weight_update_timeout_s, rollout.request_timeout_s),
        "no_engine_timeout_s": rollout.no_engine_timeout_s,
    }


class PoolLoop:
    """Where coroutines that call a pool's `agenerate` run from synchronous code: the HTTP pool's own
    event-loop thread, or (embedded engines) one loop of the calling thread, made on first use and
    kept, because the embedded pool's stepping task must stay on the loop it was started on. The
    rollout scheduler and the held-out evaluation of agent domains share one."""

    def __init__(self, pool: EmbeddedEnginePool | HTTPEnginePool) -> None:
        self._pool_loop = pool.loop if isinstance(pool, HTTPEnginePool) else None
        self._own_loop: asyncio.AbstractEventLoop | None = None

    def run(self, coro: Any) -> Any:
        """Run `coro` to its end on the pool's loop and return its result (blocks the caller)."""
        if self._pool_loop is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._pool_loop).result()
        if self._own_loop is None:
            self._own_loop = asyncio.new_event_loop()
        return self._own_loop.run_until_complete(coro)

    @property
    def usable(self) -> bool:
        """False once the loop it runs on is closed (the pool closed, or `close()`)."""
        loop = self._pool_loop or self._own_loop
        return loop is None or not loop.is_closed()

    def close(self) -> None:
        """Close the loop this object made (the HTTP pool's loop is the pool's to close)."""
        if self._own_loop is not None and not self._own_loop.is_closed():
            self._own_loop.close()


def build_engine_pool(
    rollout: RolloutConfig,
    model: ModelConfig,
    tokenizer: Any,
    seed: int,
    *,
    workdir: str | None = None,
    tokenizer_path: str | None = None,
) -> EmbeddedEnginePool | HTTPEnginePool:
    """The pool `rollout` asks for: the servers of `engine_urls`; else `mcore-rl serve` processes
    this trainer starts (async runtime, or `engine_processes: true`; their files and logs go to
    `workdir`); else embedded engines in this process. Engines the trainer builds run in the
    `logprobs_mode` it expects (`expected_logprobs_mode`); given servers are checked
    (`check_logprobs_mode`)."""

    if rollout.engine_kind == "vllm":
        return build_vllm_pool(rollout, model, tokenizer, seed, workdir=workdir)
    mode = expected_logprobs_mode(rollout)
    if rollout.engine_urls:
        pool = HTTPEnginePool(
            rollout.engine_urls,
            timeout=rollout.request_timeout_s,
            api_key=rollout.api_key,
            admin_api_key=rollout.admin_api_key,
            health_interval=rollout.health_check_interval_s,
            num_layers=model.num_layers,
            **engine_timeouts(rollout),
        )
        try:
            check_logprobs_mode(pool, rollout)
        except BaseException:
            pool.close()
            raise
        return pool
    if started_engines(rollout):
        procs = EngineProcesses.start(
            model,
            num=rollout.num_embedded_engines,
            workdir=workdir or "engines",
            tokenizer_path=tokenizer_path,
            quantization=rollout.quantization,
            max_running_requests=rollout.max_running_requests,
            context_length=rollout.context_length,
            seed=seed,
            cores=rollout.engine_cores or None,
            devices=rollout.engine_devices or None,
            threads=rollout.engine_threads,
            api_key=rollout.api_key,
            admin_api_key=rollout.admin_api_key,
            startup_timeout_s=rollout.engine_startup_timeout_s,
            extra_args=["--logprobs-mode", mode, *speculative_flags(rollout)],
        )
        try:
            return HTTPEnginePool(
                procs.urls,
                timeout=rollout.request_timeout_s,
                api_key=rollout.api_key,
                admin_api_key=rollout.admin_api_key,
                processes=procs,
                restart_dead=rollout.restart_engines,
                health_interval=rollout.health_check_interval_s,
                num_layers=model.num_layers,
                **engine_timeouts(rollout),
            )
        except BaseException:
            procs.close()
            raise
    return EmbeddedEnginePool.build(
        model,
        tokenizer,
        num=rollout.num_embedded_engines,
        quantization=rollout.quantization,
        max_running_requests=rollout.max_running_requests,
        context_length=rollout.context_length,
        seed=seed,
        logprobs_mode=mode,
        speculative=speculative_settings(rollout),
    )


def speculative_flags(rollout: RolloutConfig) -> list[str]:
    """`mcore-rl serve` flags of `rollout.speculative_*` (none when off)."""
    if rollout.speculative_algorithm == "none":
        return []
    flags = ["--speculative-algorithm", rollout.speculative_algorithm.upper()]
    flags += ["--speculative-num-steps", str(rollout.speculative_num_steps)]
    if rollout.speculative_draft_model_path:
        flags += ["--speculative-draft-model-path", rollout.speculative_draft_model_path]
    if rollout.speculative_schedule != "fixed":
        flags += ["--speculative-schedule", rollout.speculative_schedule]
    if rollout.speculative_confidence_head:
        flags += ["--speculative-confidence-head", rollout.speculative_confidence_head]
    return flags


def speculative_settings(rollout: RolloutConfig) -> SpeculativeSettings | None:
    """The embedded engines' `SpeculativeSettings` of `rollout.speculative_*` (None when off)."""
    if rollout.speculative_algorithm == "none":
        return None
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings  # lazy: transformers

    return SpeculativeSettings(
        algorithm=rollout.speculative_algorithm.upper(),
        num_steps=rollout.speculative_num_steps,
        draft_model_path=rollout.speculative_draft_model_path,
        schedule=rollout.speculative_schedule,
        confidence_head=rollout.speculative_confidence_head,
    )


def build_vllm_pool(
    rollout: RolloutConfig, model: ModelConfig, tokenizer: Any, seed: int, *, workdir: str | None = None
) -> HTTPEnginePool:
    """`rollout.engine_kind: vllm`: the vLLM servers of `engine_urls`, else `num_embedded_engines`
    vLLM processes this trainer starts (`vllm_processes.py`; files and logs in `workdir`), behind
    `VLLMEngineClient`s; the trainer's tokenizer decodes their token ids."""
    from mcore_rl.rollout.vllm_client import VLLMEngineClient  # lazy: aiohttp
    from mcore_rl.rollout.vllm_processes import VLLMEngineProcesses  # lazy: the vLLM backend only

    client = functools.partial(
        VLLMEngineClient,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        eos_token_id=tokenizer.eos_id,
    )
    common: dict[str, Any] = dict(
        timeout=rollout.request_timeout_s,
        api_key=rollout.api_key,
        admin_api_key=rollout.admin_api_key,
        health_interval=rollout.health_check_interval_s,
        num_layers=model.num_layers,
        client_factory=client,
        **engine_timeouts(rollout),
    )
    if rollout.engine_urls:
        return HTTPEnginePool(rollout.engine_urls, **common)
    procs = VLLMEngineProcesses.start_vllm(
        model,
        num=rollout.num_embedded_engines,
        workdir=workdir or "engines",
        python=rollout.vllm_python,
        dtype="bfloat16" if rollout.quantization == "bf16" else "float32",
        max_running_requests=rollout.max_running_requests,
        context_length=rollout.context_length,
        seed=seed,
        cores=rollout.engine_cores or None,
        threads=rollout.engine_threads,
        api_key=rollout.api_key,
        startup_timeout_s=rollout.engine_startup_timeout_s,
    )
    try:
        return HTTPEnginePool(procs.urls, processes=procs, restart_dead=rollout.restart_engines, **common)
    except BaseException:
        procs.close()
        raise


class EmbeddedEnginePool:
    """`EngineCore`s in this process, stepped in turn until every request has finished: all at
    once (`generate`), or from an event loop one step at a time (`agenerate`)."""

    def __init__(self, cores: Sequence[Any]) -> None:
        self.cores = list(cores)
        self._arriving: list[tuple[GenRequest, asyncio.Future[Generation]]] = []  # for `agenerate`
        self._stepper: asyncio.Task[None] | None = None

    @classmethod
    def build(
        cls,
        mc: ModelConfig,
        tokenizer: Any,
        *,
        num: int,
        quantization: str,
        max_running_requests: int,
        context_length: int,
        seed: int,
        logprobs_mode: str = "raw",
        speculative: SpeculativeSettings | None = None,
    ) -> EmbeddedEnginePool:
        """`num` engines holding an (uninitialised) reference model of `mc`; the first weight sync
        fills them. `quantization`: "fp8" (e4m3 block weights), "bf16" or "none" (fp32).

        The engines report log-probs of the temperature-scaled distribution they sample from
        (SGLang's default, `return_original_logprob=False`), and the learner recomputes π at the
        same temperature, so μ and π are the same function of the logits. `logprobs_mode`
        "processed" (sampling-mask replay) makes them those of the renormalised top-k/top-p
        distribution instead (`EngineCore`). `speculative` (`SpeculativeSettings`, None = off): exact
        speculative decoding, a STANDALONE draft model loaded once from its path and copied per engine."""
        from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config  # lazy: transformers
        from mcore_rl.rollout.engine.core import EngineCore, load_draft_model  # lazy: transformers

        draft = None
        if speculative is not None and speculative.algorithm == "STANDALONE":
            if not speculative.draft_model_path:
                raise ValueError("speculative_draft_model_path: STANDALONE speculative decoding needs a draft model")
            draft = load_draft_model(speculative.draft_model_path)
        cores = []
        for i in range(num):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + i)
                model = McoreRLForCausalLM(hf_config_from_model_config(mc))
            cores.append(
                EngineCore(
                    model,
                    tokenizer,
                    max_running_requests=max_running_requests,
                    context_length=context_length,
                    quantization="fp8" if quantization == "fp8" else None,
                    dtype="bfloat16" if quantization == "bf16" else "float32",
                    random_seed=seed + i,
                    return_original_logprob=False,
                    logprobs_mode=logprobs_mode,
                    device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None,
                    speculative=speculative,
                    draft_model=copy.deepcopy(draft) if draft is not None else None,
                )
            )
        return cls(cores)

    @property
    def weight_version(self) -> int:
        return self.cores[0].weight_version

    def weight_transport(self, rollout: RolloutConfig) -> Transport:
        return InProcessTransport(self.cores)

    def _add(self, requests: Sequence[GenRequest]) -> list[str]:
        """Hand `requests` to the engines in turn (request i to engine i mod n); their request ids."""
        from mcore_rl.rollout.engine.core import Request  # lazy: transformers
        from mcore_rl.rollout.engine.sampling import SamplingParams  # lazy: transformers

        rids = [r.rid or uuid.uuid4().hex for r in requests]
        for i, (req, rid) in enumerate(zip(requests, rids)):
            self.cores[i % len(self.cores)].add_request(
                Request(
                    rid,
                    list(req.input_ids),
                    SamplingParams(**req.sampling_params),
                    return_logprob=True,
                    return_routed_experts=req.return_routed_experts,
                    return_sampling_mask=req.return_sampling_mask,
                    logprob_start_len=req.logprob_start_len if req.logprob_start_len is not None else -1,
                )
            )
        return rids

    def _step(self, wanted: Callable[[str], GenRequest | None]) -> tuple[bool, list[tuple[str, Generation]]]:
        """One step of every engine with work: (whether any had work, the finished requests that
        `wanted` knows, as (rid, Generation))."""
        done: list[tuple[str, Generation]] = []
        progressed = False
        for j, core in enumerate(self.cores):
            if not core.has_work():
                continue
            progressed = True
            for out in core.step():
                req = wanted(out.rid) if out.finished else None
                if req is None:
                    continue
                mask = req.return_sampling_mask
                gen = Generation(
                    list(out.output_ids),
                    [lp for lp, _ in out.output_token_logprobs],
                    int(out.weight_version),
                    (out.finish_reason or {}).get("type", "abort"),
                    out.text or "",
                    f"embedded:{j}",
                    routed_experts=out.routed_experts,
                    output_sampling_masks=out.output_token_sampling_mask if mask else None,
                    output_sampling_logprobs=out.output_token_sampling_logprobs if mask else None,
                    input_logprobs=(
                        [float(lp) for lp, _ in out.input_token_logprobs[1:]]
                        if req.logprob_start_len is not None
                        else None
                    ),
                )
                done.append((out.rid, gen))
        return progressed, done

    def generate(self, requests: Sequence[GenRequest], on_done: Callable[[], None] | None = None) -> list[Generation]:
        rids = self._add(requests)
        where = {rid: i for i, rid in enumerate(rids)}
        results: list[Generation | None] = [None] * len(requests)
        pending = len(requests)
        while pending:
            progressed, done = self._step(lambda rid: requests[where[rid]] if rid in where else None)
            for rid, gen in done:
                results[where[rid]] = gen
                pending -= 1
                if on_done is not None:
                    on_done()
            if not progressed:
                raise RuntimeError(f"embedded engines went idle with {pending} requests unfinished")
        return results  # type: ignore[return-value]  # every slot was filled: pending reached 0

    async def agenerate(self, req: GenRequest) -> Generation:
        """One request from a running event loop (the rollout scheduler's call): the requests that
        arrive within one turn of the loop join the engines together, as one `generate` call's
        would, and a stepping task runs the engines, yielding to the loop after every step."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Generation] = loop.create_future()
        self._arriving.append((req, fut))
        if self._stepper is None or self._stepper.done():
            self._stepper = loop.create_task(self._run_engines())
        return await fut

    async def _run_engines(self) -> None:
        running: dict[str, tuple[GenRequest, asyncio.Future[Generation]]] = {}
        try:
            while self._arriving or running:
                if self._arriving:
                    batch, self._arriving = self._arriving, []
                    for rid, (req, fut) in zip(self._add([r for r, _ in batch]), batch):
                        running[rid] = (req, fut)
                progressed, done = self._step(lambda rid: running[rid][0] if rid in running else None)
                for rid, gen in done:
                    _, fut = running.pop(rid)
                    if not fut.done():
                        fut.set_result(gen)
                if not progressed and running:
                    raise RuntimeError(f"embedded engines went idle with {len(running)} requests unfinished")
                await asyncio.sleep(0)  # let the finished requests' callers go on (and new ones arrive)
        except BaseException as err:
            for _, fut in [*running.values(), *self._arriving]:
                if not fut.done():
                    fut.set_exception(err if isinstance(err, Exception) else RuntimeError("engine stepping cancelled"))
            self._arriving = []
            raise

    def close(self) -> None:
        pass


class HTTPEnginePool:
    """SGLang-compatible servers, called from a private event-loop thread (the trainer is
    synchronous): generation through `EngineRouter`, control and weight updates to every live engine.

    Every engine's state (starting, serving, waiting for weights, syncing, dead) is kept by
    `router.states` (`engine_state.EngineStates`); the pool reports what it sees there. An engine
    that cannot be reached, or does not answer within its timeout (`timeout` for generation,
    `control_timeout` for control calls, `weight_update_timeout` for weight updates), is marked dead
    and left out of everything (generation fails over, fan-outs skip it) until its `/health`
    answers again; it then serves again only once it holds the pool's current weights. Requests
    carry rids, so a failover never runs one twice. A fan-out that waits longer than `log_wait_s`
    logs which engines and which call it is waiting for.

    With `processes` (the `EngineProcesses` that serve `urls`, in order) the pool owns them: it
    stops them on `close()` and, with `restart_dead`, starts one again when its process died —
    several at once, each launched without waiting for the others to answer; a restarted engine
    serves again after the next weight sync, like any engine that came back.

    Weight updates (`weight_update` ... `delivered`): an engine resumes only once it got the whole
    update and, when the transport passes the trainer's checksum, its `/weights_checksum` agrees;
    any other engine paused for the update (a sync that failed halfway, a mismatch) stays paused
    and out of routing, since it may hold a mix of two versions, until a later update reaches it.
    An update that finds no engine to send to waits up to `no_engine_timeout_s` for one (a
    restarting engine, one that answers again) before it raises `NoHealthyEngine`."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float = 600.0,
        concurrency: int = 512,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        health_interval: float = 5.0,
        log_wait_s: float = 10.0,
        processes: EngineProcesses | None = None,
        restart_dead: bool = False,
        num_layers: int | None = None,
        control_timeout: float | None = None,
        weight_update_timeout: float | None = None,
        no_engine_timeout_s: float = 0.0,
        client_factory: Callable[..., Any] | None = None,
    ) -> None:
        """`client_factory`: the engines' client class (None: `EngineClient`, SGLang's protocol;
        `VLLMEngineClient` with its options bound for vLLM servers)."""
        from mcore_rl.rollout.client import EngineClient  # lazy: aiohttp
        from mcore_rl.rollout.router import EngineRouter  # lazy: aiohttp

        if not urls:
            raise ValueError("urls: need at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.processes, self.restart_dead = processes, restart_dead
        self.num_layers = num_layers  # the served model's: shapes meta_info["routed_experts"] (routing replay)
        self.concurrency, self.timeout, self.log_wait_s = concurrency, timeout, log_wait_s
        self.no_engine_timeout_s = no_engine_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-pool-http", daemon=True)
        self._thread.start()

        async def make_router() -> Any:
            router = EngineRouter(
                self.urls,
                timeout=timeout,
                api_key=api_key,
                admin_api_key=admin_api_key,
                health_interval=health_interval,
                control_timeout=control_timeout,
                weight_update_timeout=weight_update_timeout,
                client_factory=client_factory or EngineClient,
            )
            router.start()
            return router

        self.router = self._run(make_router())
        self.states = self.router.states
        self._transport: Transport | None = None
        self._no_checksum: set[str] = set()  # engines without /weights_checksum (real SGLang), logged once
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        if processes is not None and restart_dead:
            # a thread of its own: an engine process dies with the thread that started it (PDEATHSIG)
            self._watcher = threading.Thread(
                target=self._restart_dead, args=(health_interval,), name="engine-restarter", daemon=True
            )
            self._watcher.start()

    def _restart_dead(self, interval: float) -> None:
        """Start engine processes that died again (same URL), all that died, without waiting for
        one to answer before noticing the next; each waits for weights once it answers."""
        processes = self.processes
        assert processes is not None  # the watcher runs only for a pool that started its engines
        starting: set[int] = set()  # launched again, not answering yet
        while not self._stop_watch.wait(min(interval, 0.2) if starting else interval):
            for i, url in enumerate(self.urls):
                if self._stop_watch.is_set():
                    return
                if i in starting:
                    try:
                        if not processes.poll_start(i):
                            continue
                        self.states.process_ready(url, self._run(self.router._version_of(url)))
                    except Exception:
                        logger.exception("engine %s did not come back", url)
                    starting.discard(i)
                    continue
                if processes.alive(i):
                    continue
                logger.warning("engine process %s (%s) died; starting it again", i, url)
                self.states.process_restarted(url)
                try:
                    processes.relaunch(i)
                    starting.add(i)
                except Exception:
                    logger.exception("could not restart engine %s", url)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def weight_version(self) -> int:
        return int(next(iter(self.call("get_weight_version", {}).values())))

    @property
    def live(self) -> list[str]:
        """Engines that take generation requests, in URL order."""
        routable = set(self.states.routable())
        return [u for u in self.urls if u in routable]

    # ---- fan-out to every live engine (control and weight updates) ---------------------------

    def update_targets(self) -> list[str]:
        """Engines a weight update goes to: the live ones and those back but waiting for weights."""
        targets = set(self.states.update_targets())
        return [u for u in self.urls if u in targets]

    def start(
        self, method: str, kwargs: dict | Callable[[int], dict], urls: Sequence[str] | None = None
    ) -> dict[str, Future]:
        """Call `EngineClient.<method>(**kwargs)` on `urls` (default: the live engines; `kwargs` may
        be a function of the engine's index in `urls`); returns the pending futures by URL."""
        urls = self.live if urls is None else list(urls)
        return {
            u: asyncio.run_coroutine_threadsafe(
                getattr(self.router.clients[u], method)(**(kwargs(i) if callable(kwargs) else kwargs)), self._loop
            )
            for i, u in enumerate(urls)
        }

    def wait(self, futures: dict[str, Future], what: str) -> dict[str, Any]:
        """The replies of the engines that answered. An engine that cannot be reached (or timed
        out) is marked dead and left out; an engine's refusal (HTTP 4xx) is raised; so is
        `NoHealthyEngine` when no engine answered."""
        from mcore_rl.rollout.router import NoHealthyEngine  # lazy: aiohttp

        results, error = {}, None
        for url, (reply, err) in self._settle(futures, what).items():
            if err is None:
                results[url] = reply
            else:
                error = error or err
        if error is not None:
            raise error
        if futures and not results:
            raise NoHealthyEngine(f"{what}: no engine answered (tried {', '.join(futures)})")
        return results

    def _settle(self, futures: dict[str, Future], what: str) -> dict[str, tuple[Any, Exception | None]]:
        """(reply, None) or (None, error) by URL for the engines that answered, once all have, logging
        while it waits; an engine that cannot be reached is marked dead and left out."""
        from mcore_rl.rollout.client import EngineUnavailable  # lazy: aiohttp

        pending = dict(futures)
        start = time.monotonic()
        while pending:
            done, _ = concurrent.futures.wait(pending.values(), timeout=self.log_wait_s)
            if not done:
                limit = self.router.clients[next(iter(pending))].timeout_for(what)
                logger.warning(
                    "waited %.0f s (timeout %.0f s) for %s from %s",
                    time.monotonic() - start,
                    limit,
                    what,
                    ", ".join(sorted(pending)),
                )
            pending = {u: f for u, f in pending.items() if not f.done()}
        out: dict[str, tuple[Any, Exception | None]] = {}
        for url, f in futures.items():
            try:
                out[url] = (f.result(), None)
            except EngineUnavailable as err:
                logger.warning(
                    "engine %s is unreachable during %s (%s); it is left out until it answers again", url, what, err
                )
                self.states.unreachable(url)
            except Exception as err:
                out[url] = (None, err)
        return out

    def call(
        self, method: str, kwargs: dict | Callable[[int], dict], urls: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """`start` and `wait`: the replies by URL of the engines that answered."""
        return self.wait(self.start(method, kwargs, urls), f"/{method}")

    @contextlib.contextmanager
    def weight_update(self, mode: str, urls: Sequence[str] | None = None) -> Iterator[list[str]]:
        """Pause `urls` (default: every update target, waiting up to `no_engine_timeout_s` for one
        when there is none) so that no token is generated from half-updated weights; yields the
        engines that answered. Transports shrink the list as engines drop out, then call
        `delivered` for those that got everything. On the way out those continue
        (`/continue_generation`); every other engine paused here stays paused and waits for the
        next update, also when the update raised: it may hold a mix of two versions."""
        from mcore_rl.rollout.router import NoEngineToSync  # lazy: aiohttp

        deadline, logged = time.monotonic() + self.no_engine_timeout_s, False
        while True:
            asked = self.update_targets() if urls is None else list(urls)
            replies = self._settle(self.start("pause_generation", {"mode": mode}, asked), "/pause_generation")
            targets = [u for u, (_, err) in replies.items() if err is None]
            refused = next((err for _, err in replies.values() if err is not None), None)
            if refused is not None or targets or urls is not None or time.monotonic() >= deadline:
                break
            if not logged:
                logger.warning(
                    "weight update: no engine to send to (%s); waiting up to %.0f s "
                    "(rollout.no_engine_timeout_s) for one to come back",
                    self.states.summary(),
                    self.no_engine_timeout_s,
                )
                logged = True
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        if refused is not None or not targets:  # nothing was sent yet: the paused ones may go on
            if targets:
                self.call("continue_generation", {}, targets)
            if refused is not None:
                raise refused
            waited = f" after waiting {self.no_engine_timeout_s:g} s (rollout.no_engine_timeout_s)" if logged else ""
            raise NoEngineToSync(
                f"weight update: no engine to send the weights to answered{waited}; {self.states.summary()}"
            )
        paused = list(targets)
        self.states.sync_begin(paused)
        try:
            yield targets
        finally:
            resume = self.states.sync_end(paused)
            if resume:
                self.call("continue_generation", {}, resume)

    def delivered(self, urls: Sequence[str], version: int, checksum: WeightChecksum | None = None) -> dict[str, str]:
        """`urls` received every tensor of `version`. With `checksum` (the trainer's
        `WeightChecksum` of what it sent) each engine's `/weights_checksum` is compared first; the
        engines that agree, or have no such endpoint (logged once), serve again (those paused for
        the update once it ends). Returns the others, with why (an engine that cannot be reached
        for the check just drops out)."""
        problems = self.verify(urls, version, checksum) if checksum is not None else {}
        for u in urls:
            if u not in problems:
                self.states.delivered(u, str(version))
        return problems

    def verify(self, urls: Sequence[str], version: int, checksum: WeightChecksum) -> dict[str, str]:
        """Engines among `urls` whose `/weights_checksum` does not show `version` with exactly the
        tensors of `checksum`, with why. Engines that answer 404 (no such endpoint: a real SGLang
        server) are not checked; that is logged once per engine."""
        from mcore_rl.rollout.client import EngineHTTPError  # lazy: aiohttp

        futures = self.start("weights_checksum", {}, [u for u in urls if u not in self._no_checksum])
        problems: dict[str, str] = {}
        for url, (reply, err) in self._settle(futures, "/weights_checksum").items():
            if isinstance(err, EngineHTTPError) and err.status == 404:
                self._no_checksum.add(url)
                logger.warning(
                    "engine %s has no /weights_checksum (a real SGLang or vLLM server): the weights it loads "
                    "are not checked against the trainer's checksum",
                    url,
                )
            elif err is not None:
                problems[url] = f"/weights_checksum failed: {err}"
            else:
                problem = checksum_problem(reply, version, checksum)
                if problem is not None:
                    problems[url] = problem
        return problems

    def weight_transport(self, rollout: RolloutConfig) -> Transport:
        """The weight transport `rollout.sync_transport` names, to every engine of the pool."""
        if rollout.sync_transport == "tensor":
            self._transport = TensorTransport(self)
        elif rollout.sync_transport == "disk":
            if rollout.sync_dir is None:  # the validation refuses this before any worker starts
                raise ValueError("rollout.sync_dir: required with rollout.sync_transport: disk")
            self._transport = DiskTransport(self, rollout.sync_dir)
        elif rollout.engine_kind == "vllm":  # vLLM's own NCCL transfer (GPU only; validation refuses it on CPU)
            from mcore_rl.rollout.vllm_weights import VLLMNcclTransport  # lazy: the vLLM backend only

            self._transport = VLLMNcclTransport(self)
        else:
            self._transport = DistributedTransport(
                self, rendezvous_timeout_s=self.router.clients[self.urls[0]].weight_update_timeout
            )
        return self._transport

    # ---- generation --------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenRequest], on_done: Callable[[], None] | None = None) -> list[Generation]:
        return self._run(self._generate(requests, on_done))

    async def _generate(
        self, requests: Sequence[GenRequest], on_done: Callable[[], None] | None = None
    ) -> list[Generation]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(req: GenRequest) -> Generation:
            async with sem:
                gen = await self.agenerate(req)
            if on_done is not None:
                on_done()
            return gen

        return list(await asyncio.gather(*(one(r) for r in requests)))

    async def agenerate(self, req: GenRequest) -> Generation:
        """One request, on the pool's event loop (`loop`): the asynchronous rollout scheduler's call."""
        fields: dict[str, Any] = {"return_routed_experts": True} if req.return_routed_experts else {}
        if req.return_sampling_mask:
            fields["return_sampling_mask"] = True
        if req.logprob_start_len is not None:
            fields["logprob_start_len"] = req.logprob_start_len
        out = await self.router.generate(
            input_ids=list(req.input_ids),
            sampling_params=dict(req.sampling_params),
            return_logprob=True,
            rid=req.rid or uuid.uuid4().hex,
            **fields,
        )
        meta = out["meta_info"]
        versions = meta.get("output_token_weight_versions")
        routed = None
        if req.return_routed_experts and meta.get("routed_experts") is not None:
            from mcore_rl.rollout.protocol import decode_routed_experts  # lazy: transformers

            if self.num_layers is None:
                raise ValueError("num_layers: HTTPEnginePool needs the model's layer count to decode routed_experts")
            routed = decode_routed_experts(
                meta["routed_experts"], len(req.input_ids) + len(out["output_ids"]), self.num_layers
            )
        gen = Generation(
            list(out["output_ids"]),
            [float(t[0]) for t in meta.get("output_token_logprobs", [])],
            int(meta.get("weight_version", 0)),
            (meta.get("finish_reason") or {}).get("type", "abort"),
            out.get("text", ""),
            str(meta.get("engine", "remote")),
            [int(v) for v in versions] if versions is not None else None,
            routed_experts=routed,
        )
        if req.logprob_start_len is not None:
            gen.input_logprobs = [float(t[0]) for t in meta.get("input_token_logprobs", [])[1:]]
        if req.return_sampling_mask:
            masks, lps = meta.get("output_token_sampling_mask"), meta.get("output_token_sampling_logprobs")
            if masks is None or lps is None or len(masks) != len(gen.output_ids) or len(lps) != len(gen.output_ids):
                raise ValueError(
                    f"return_sampling_mask: the engine's meta_info lacks output_token_sampling_mask / "
                    f"output_token_sampling_logprobs for each of its {len(gen.output_ids)} output tokens "
                    "(an engine without SGLang's sampling-mask support?)"
                )
            gen.output_sampling_masks = [[int(i) for i in m] for m in masks]
            gen.output_sampling_logprobs = [float(v) for v in lps]
        return gen

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (own thread) every engine call runs on."""
        return self._loop

    def close(self) -> None:
        try:
            self._stop_watch.set()
            if self._watcher is not None:
                self._watcher.join(timeout=60)
                self._watcher = None
            if self._transport is not None and hasattr(self._transport, "close"):
                self._transport.close()
                self._transport = None
            if not self._loop.is_closed():
                self._run(self.router.close())
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()
        finally:
            if self.processes is not None:
                self.processes.close()
