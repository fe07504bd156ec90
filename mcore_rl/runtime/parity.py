"""`mcore-rl parity`: where do the engine and the trainer disagree on the same tokens?

Users of RL trainers ask "what level of train–inference mismatch is expected, and is mine safe?".
This runs one recipe's policy (its `init` weights, or `--checkpoint`) through the trainer and
through engines of several precisions on the *same* token sequences, and reports where they
diverge:

1. **Sequences.** The first engine samples `prompts × samples` completions of the recipe's
   training prompts at the rollout temperature (its own top-p / top-k). Every engine then scores
   exactly those tokens with SGLang's prompt-scoring request (`max_new_tokens: 0`,
   `return_logprob`, `logprob_start_len = len(prompt) - 1`; the same request a real SGLang server
   answers), at temperature 1: the model's own distribution, not a sampling choice.
2. **Trainer.** `Learner.token_logprobs` — the trainer's real log-prob path (packing, megatron-core
   forward, vocab-parallel statistics) — scores the same tokens at temperature 1.
3. **Per token** d = log π_trainer − log μ_engine: mean |d|, its 99th percentile and maximum, and
   Mismatch-K3 = E[exp(d) − d − 1] (`algos.mismatch`'s diagnostic), overall and by response
   position (bins of `--position-bins` tokens).
4. **Per layer** (embedded engines; one trainer rank, no PP, not AttnRes): the engine's model in a
   debug forward (the same module the engine generates with, FP8/bf16 layers included, run on
   the whole sequence without the KV cache) and the trainer's megatron-core model, both with
   forward hooks on every decoder layer: the relative difference ‖h_engine − h_trainer‖ / ‖h_trainer‖
   of the residual stream after each layer, averaged over the response tokens; for MoE layers
   the fraction of (token, layer) whose top-k expert *set* differs (routing disagreement).
5. A self-check column: for the generating engine, |scored − sampled-time log-prob|, which should
   be ~0 (it catches an engine whose prompt scoring and decoding disagree).

For MoE models the trainer also scores each engine's tokens replaying that engine's experts
(R3, `train/routing_replay.py`; the engine returns them with SGLang's `return_routed_experts`): the
mismatch that is left once the routing agrees.

Output: a table on the terminal, and the numbers as JSON with `--json PATH`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import torch

from mcore_rl.config.model_keys.attn_res import AttnResKeys
from mcore_rl.config.loader import config_to_dict
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.rollout.pool import EmbeddedEnginePool, EnginePool, HTTPEnginePool, build_engine_pool
from mcore_rl.train.logprobs import _decoder_output_only, unwrap_gpt
from mcore_rl.runtime.loop import RLRun
from mcore_rl.train.warm_start import load_initial_weights, sft_warm_start
from mcore_rl.data.samples import compact_routing
from mcore_rl.rollout.teacher import parse_scores, scoring_body

# engine precisions the embedded engine offers (rollout.quantization's values)
PRECISIONS = ("none", "bf16", "fp8")
PRECISION_NAMES = {"none": "fp32", "bf16": "bf16", "fp8": "fp8"}


@dataclass
class PositionBin:
    start: int  # first response position of the bin
    end: int  # one past the last
    tokens: int
    mean_abs: float
    k3: float


@dataclass
class EngineParity:
    """How one engine's log-probs (and hidden states, routing) differ from the trainer's."""

    engine: str  # "fp32" / "bf16" / "fp8" (embedded) or the URL
    tokens: int
    mean_abs: float  # mean |log π − log μ| over response tokens
    p99_abs: float
    max_abs: float
    k3: float  # E[exp(d) − d − 1], d = log π − log μ
    by_position: list[PositionBin] = field(default_factory=list)
    layer_rel_diff: list[float] | None = None  # per decoder layer, then the final norm's output
    routing_disagreement: list[float | None] | None = None  # per layer (None: dense layer)
    scoring_vs_sampling: float | None = None  # generating engine: mean |scored − sampled log-prob|
    # MoE: the trainer replaying this engine's routing of the same tokens (R3)
    r3_mean_abs: float | None = None
    r3_k3: float | None = None
    seconds: float = 0.0


def token_mismatch(trainer: Sequence[float], engine: Sequence[float]) -> dict[str, float]:
    """mean |d|, p99 |d|, max |d| and K3 of d = trainer − engine (flat lists of equal length).

    The K3 of `algos.mismatch.mismatch_metrics`, but in float64 and unclamped: fp32 engines agree
    with the trainer to ~1e-7, where float32's exp(d) − d − 1 is rounding noise."""
    d = torch.tensor(trainer, dtype=torch.float64) - torch.tensor(engine, dtype=torch.float64)
    if d.numel() == 0:
        return {"mean_abs": math.nan, "p99_abs": math.nan, "max_abs": math.nan, "k3": math.nan}
    a = d.abs()
    return {
        "mean_abs": float(a.mean()),
        "p99_abs": float(torch.quantile(a, 0.99)),
        "max_abs": float(a.max()),
        "k3": float((torch.exp(d) - d - 1).mean()),
    }


def position_bins(
    trainer: Sequence[Sequence[float]], engine: Sequence[Sequence[float]], width: int
) -> list[PositionBin]:
    """`token_mismatch` by response position, in bins of `width` positions (per-sample lists)."""
    longest = max((len(t) for t in trainer), default=0)
    out = []
    for start in range(0, longest, width):
        t = [x for row in trainer for x in row[start : start + width]]
        e = [x for row in engine for x in row[start : start + width]]
        m = token_mismatch(t, e)
        out.append(PositionBin(start, min(start + width, longest), len(t), m["mean_abs"], m["k3"]))
    return out


# ------------------------------------------------------------------------------ engines


@dataclass
class Sampled:
    """One completion as the generating engine returned it."""

    ids: list[int]
    logp: list[float]  # output_token_logprobs (raw: the full distribution at the sampling temperature)
    masks: list[list[int]] | None = None  # return_sampling_mask: the support of each token
    processed_logp: list[float] | None = None  # ... and its log-prob under the renormalised support
    routed: Any = None  # return_routed_experts of the sampled sequence


class EmbeddedScorer:
    """An embedded `EngineCore`: generation, prompt scoring and the debug forward of its model."""

    def __init__(self, core: Any, name: str) -> None:
        self.core, self.name = core, name

    def _run(self, requests: list[Any]) -> dict[str, Any]:
        for r in requests:
            self.core.add_request(r)
        done: dict[str, Any] = {}
        while len(done) < len(requests):
            if not self.core.has_work():
                raise RuntimeError(f"engine {self.name} went idle with {len(requests) - len(done)} requests left")
            for out in self.core.step():
                if out.finished:
                    done[out.rid] = out
        return done

    def generate(
        self,
        prompts: Sequence[list[int]],
        sampling: Sequence[dict[str, Any]],
        mask: bool = False,
        routing: bool = False,
    ) -> list[Sampled]:
        from mcore_rl.rollout.engine.core import Request  # lazy: transformers
        from mcore_rl.rollout.engine.sampling import SamplingParams  # lazy: transformers

        reqs = [
            Request(
                f"g{i}",
                list(p),
                SamplingParams(**sp),
                return_logprob=True,
                return_sampling_mask=mask,
                return_routed_experts=routing,
            )
            for i, (p, sp) in enumerate(zip(prompts, sampling))
        ]
        done = self._run(reqs)
        return [
            Sampled(
                list(o.output_ids),
                [lp for lp, _ in o.output_token_logprobs],
                list(o.output_token_sampling_mask) if mask else None,
                list(o.output_token_sampling_logprobs) if mask else None,
                o.routed_experts if routing else None,
            )
            for o in (done[r.rid] for r in reqs)
        ]

    def score(
        self, prompts: Sequence[list[int]], responses: Sequence[list[int]], routing: bool = False
    ) -> tuple[list[list[float]], list[Any] | None]:
        """Prompt-scoring log-probs of each response (and, with `routing`, the experts of every
        token, SGLang's routed_experts [tokens - 1, layers, k])."""
        from mcore_rl.rollout.engine.core import Request  # lazy: transformers
        from mcore_rl.rollout.engine.sampling import SamplingParams  # lazy: transformers

        reqs = [
            Request(
                f"s{i}",
                list(p) + list(r),
                SamplingParams(max_new_tokens=0),
                return_logprob=True,
                logprob_start_len=len(p) - 1,
                return_routed_experts=routing,
            )
            for i, (p, r) in enumerate(zip(prompts, responses))
        ]
        done = self._run(reqs)
        lps = [[lp for lp, _ in done[q.rid].input_token_logprobs[1:]] for q in reqs]
        return lps, ([done[q.rid].routed_experts for q in reqs] if routing else None)

    @torch.no_grad()
    def hidden_and_routing(self, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Debug forward of the engine's model on `ids`: the residual stream after each decoder
        layer and the final norm ([s, h] fp32 each), and per layer the top-k expert ids [s, k]
        (None for dense layers)."""
        model = self.core.model
        inner = model.model
        hidden: list[torch.Tensor] = []
        routes: list[torch.Tensor | None] = [None] * len(inner.layers)
        handles = []
        for i, layer in enumerate(inner.layers):
            handles.append(layer.register_forward_hook(lambda _m, _a, out: hidden.append(out[0][0].float().cpu())))
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            topk = getattr(getattr(layer, "mlp", None), "topk", None)
            if isinstance(gate, torch.nn.Linear) and topk:

                def hook(_m: Any, _a: Any, out: torch.Tensor, i: int = i, k: int = int(topk)) -> None:
                    routes[i] = torch.topk(out.reshape(-1, out.shape[-1]).float(), k, dim=-1).indices.cpu()

                handles.append(gate.register_forward_hook(hook))
        handles.append(inner.norm.register_forward_hook(lambda _m, _a, out: hidden.append(out[0].float().cpu())))
        try:
            device = next(model.parameters()).device
            inner(torch.tensor([ids], device=device))
        finally:
            for h in handles:
                h.remove()
        return hidden, routes


class URLScorer:
    """An SGLang-compatible server (a real SGLang URL or `mcore-rl serve`), over its HTTP API; with
    `pool` (the `HTTPEnginePool` of that URL) through the pool's client, which speaks the engine's
    protocol (SGLang's, or vLLM's with `rollout.engine_kind: vllm`)."""

    def __init__(self, url: str, num_layers: int, pool: HTTPEnginePool | None = None) -> None:
        self.name, self.num_layers, self.pool = url, num_layers, pool

    def _gather(self, bodies: list[dict[str, Any]]) -> list[Any]:
        from mcore_rl.rollout.client import EngineClient  # lazy: aiohttp

        if self.pool is not None:
            client = self.pool.router.clients[self.name.rstrip("/")]

            async def through_pool() -> list[Any]:
                return await asyncio.gather(*(client.generate(b) for b in bodies))

            return asyncio.run_coroutine_threadsafe(through_pool(), self.pool.loop).result()

        async def go() -> list[Any]:
            async with EngineClient(self.name) as client:
                return await asyncio.gather(*(client.generate(b) for b in bodies))

        return asyncio.run(go())

    def generate(
        self,
        prompts: Sequence[list[int]],
        sampling: Sequence[dict[str, Any]],
        mask: bool = False,
        routing: bool = False,
    ) -> list[Sampled]:
        from mcore_rl.rollout.protocol import decode_routed_experts  # lazy: transformers

        bodies = [
            {"input_ids": list(p), "sampling_params": sp, "return_logprob": True} for p, sp in zip(prompts, sampling)
        ]
        for b in bodies:
            if mask:
                b["return_sampling_mask"] = True
            if routing:
                b["return_routed_experts"] = True
        replies = self._gather(bodies)
        out = []
        for p, r in zip(prompts, replies):
            meta = r["meta_info"]
            out.append(
                Sampled(
                    list(r["output_ids"]),
                    [e[0] for e in meta["output_token_logprobs"]],
                    [list(m) for m in meta["output_token_sampling_mask"]] if mask else None,
                    [float(x) for x in meta["output_token_sampling_logprobs"]] if mask else None,
                    decode_routed_experts(meta["routed_experts"], len(p) + len(r["output_ids"]), self.num_layers)
                    if routing
                    else None,
                )
            )
        return out

    def score(
        self, prompts: Sequence[list[int]], responses: Sequence[list[int]], routing: bool = False
    ) -> tuple[list[list[float]], list[Any] | None]:
        from mcore_rl.rollout.protocol import decode_routed_experts  # lazy: transformers

        bodies = [scoring_body(p, r, 0, f"parity-{i}") for i, (p, r) in enumerate(zip(prompts, responses))]
        if routing:
            for b in bodies:
                b["return_routed_experts"] = True
        replies = self._gather(bodies)
        out = []
        for i, (reply, r) in enumerate(zip(replies, responses)):
            try:  # the engine teachers' parser: a reply that does not score exactly `r` is refused
                out.append(parse_scores(reply, r, 0, 0, self.name).logp)
            except ValueError as err:
                raise ValueError(f"{self.name}: scoring reply {i}: {err}") from None
        routes = None
        if routing:
            routes = [
                decode_routed_experts(reply["meta_info"]["routed_experts"], len(p) + len(r), self.num_layers)
                for reply, p, r in zip(replies, prompts, responses)
            ]
        return out, routes


# ------------------------------------------------------------------------------ trainer side


@torch.no_grad()
def trainer_hidden_and_routing(chunks: list, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The trainer's megatron-core model on `ids` (one rank, one chunk): the residual stream after
    each decoder layer and the final norm ([s, h] fp32), and each MoE layer's top-k expert ids."""

    gpt = unwrap_gpt(chunks[0])
    decoder: Any = gpt.decoder  # megatron-core's TransformerBlock (torch types a submodule `Tensor | Module`)
    layers = decoder.layers
    hidden: list[torch.Tensor] = []
    routes: list[torch.Tensor | None] = [None] * len(layers)
    handles = []
    for i, layer in enumerate(layers):
        handles.append(
            layer.register_forward_hook(
                lambda _m, _a, out: hidden.append((out[0] if isinstance(out, tuple) else out)[:, 0].float().cpu())
            )
        )
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:

            def hook(m: Any, _a: Any, out: Any, i: int = i) -> None:
                routing_map = out[1]  # [tokens, experts] bool
                routes[i] = torch.topk(routing_map.float() + 0.0, m.topk, dim=-1).indices.cpu()

            handles.append(router.register_forward_hook(hook))
    final_norm = getattr(gpt.decoder, "final_layernorm", None)
    if final_norm is not None:
        handles.append(final_norm.register_forward_hook(lambda _m, _a, out: hidden.append(out[:, 0].float().cpu())))
    device = next(gpt.parameters()).device
    tokens = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    was_training = gpt.training
    gpt.eval()
    try:
        with _decoder_output_only(gpt):
            gpt(tokens, positions, None)
    finally:
        for h in handles:
            h.remove()
        gpt.train(was_training)
    return hidden, routes


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of ‖a − b‖ / ‖b‖ (relative to the trainer's hidden states `b`)."""
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).mean())


def routing_disagreement(engine: torch.Tensor, trainer: torch.Tensor) -> float:
    """Fraction of rows whose top-k expert *sets* differ ([rows, k] ids each)."""
    return float((engine.sort(-1).values != trainer.sort(-1).values).any(-1).float().mean())


def layer_report(
    engine: EmbeddedScorer, chunks: list, sequences: Sequence[tuple[list[int], list[int]]]
) -> tuple[list[float], list[float | None]]:
    """Per layer (and the final norm): the mean relative hidden-state difference over the response
    positions of `sequences` ((prompt, response) pairs), and the MoE routing disagreement."""
    diffs: list[list[float]] = []
    agree: list[list[float]] = []
    moe_layers: set[int] = set()
    for prompt, response in sequences:
        ids = list(prompt) + list(response)
        # positions whose output predicts a response token: len(prompt)-1 … len(ids)-2
        rows = slice(len(prompt) - 1, len(ids) - 1)
        h_e, r_e = engine.hidden_and_routing(ids)
        h_t, r_t = trainer_hidden_and_routing(chunks, ids)
        diffs.append([rel_diff(a[rows], b[rows]) for a, b in zip(h_e, h_t)])
        row = []
        for i, (a, b) in enumerate(zip(r_e, r_t)):
            if a is None or b is None:
                row.append(math.nan)
                continue
            moe_layers.add(i)
            row.append(routing_disagreement(a[rows], b[rows]))
        agree.append(row)
    layer_means = [sum(col) / len(col) for col in zip(*diffs)]
    routing = [None if i not in moe_layers else sum(col) / len(col) for i, col in enumerate(zip(*agree))]
    return layer_means, routing


# ------------------------------------------------------------------------------ the report


@dataclass
class ParityOptions:
    precisions: list[str] = field(default_factory=lambda: ["none", "bf16", "fp8"])
    engine_urls: list[str] = field(default_factory=list)  # SGLang-compatible servers (scored too)
    num_prompts: int = 16
    samples_per_prompt: int = 4
    position_bins: int = 16
    layers: bool = True  # the per-layer report (embedded engines, one rank)
    routing_replay: bool = True  # MoE: also score with the engine's routing replayed (R3)
    checkpoint: str | None = None  # weights to compare instead of the recipe's init


def check_options(opts: ParityOptions) -> None:
    """ValueError naming the option that cannot work (the command calls this before building anything)."""
    bad = [p for p in opts.precisions if p not in PRECISIONS]
    if bad:
        raise ValueError(f"--precisions: {bad[0]!r} is not one of {list(PRECISIONS)}")
    if not opts.precisions and not opts.engine_urls:
        raise ValueError("nothing to compare: give --precisions and/or --engine-url")
    if opts.num_prompts < 1 or opts.samples_per_prompt < 1 or opts.position_bins < 1:
        raise ValueError("--prompts, --samples and --position-bins must be >= 1")


def run_parity(cfg: RLConfig, opts: ParityOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the recipe's policy, sync it to each engine, and compare (module docstring)."""
    import copy

    from mcore_rl.train.rl_step import Learner  # lazy: megatron
    from mcore_rl.train.weight_sync import WeightSync  # lazy: transformers

    check_options(opts)
    start = time.perf_counter()
    run = RLRun(cfg)

    if opts.checkpoint:
        load_initial_weights(opts.checkpoint, run.chunks, log)
    else:
        if cfg.init.checkpoint:
            load_initial_weights(cfg.init.checkpoint, run.chunks, log)
        if cfg.init.sft.train.train_iters > 0:
            sft_warm_start(cfg, run.chunks, run.tokenizer, run.world, log, run.held_out_texts)
    r = cfg.rollout
    engines: list[tuple[EmbeddedScorer | URLScorer, EnginePool | None]] = []  # (scorer, pool to close)
    for p in opts.precisions:
        pool = EmbeddedEnginePool.build(
            cfg.model,
            run.tokenizer,
            num=1,
            quantization=p,
            max_running_requests=max(64, opts.num_prompts * opts.samples_per_prompt),
            context_length=r.context_length,
            seed=cfg.train.seed,
        )
        WeightSync(
            run.chunks,
            cfg.model,
            pool.weight_transport(r),
            bucket_bytes=r.sync_bucket_mb << 20,
            quantization="fp8" if p == "fp8" else None,
        ).sync(1)
        engines.append((EmbeddedScorer(pool.cores[0], PRECISION_NAMES[p]), pool))
    for url in opts.engine_urls:
        rc = copy.deepcopy(r)
        rc.engine_urls = [url]
        url_pool = build_engine_pool(
            rc, cfg.model, run.tokenizer, cfg.train.seed, workdir=cfg.run_dir, tokenizer_path=cfg.data.tokenizer_path
        )
        url_transport = url_pool.weight_transport(rc)
        if hasattr(url_transport, "pause_mode"):  # as the trainer's loop does (vLLM refuses SGLang's retract)
            url_transport.pause_mode = rc.pause_mode
        WeightSync(
            run.chunks,
            cfg.model,
            url_transport,
            bucket_bytes=r.sync_bucket_mb << 20,
            quantization="fp8" if r.quantization == "fp8" else None,
        ).sync(1)
        engines.append(
            (URLScorer(url, cfg.model.num_layers, url_pool if isinstance(url_pool, HTTPEnginePool) else None), url_pool)
        )
    log(f"parity: policy and {len(engines)} engine(s) ready in {time.perf_counter() - start:.1f} s")

    prompts: list[Prompt] = run.prompts.take(opts.num_prompts)
    sp = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_new_tokens}
    prompt_ids = [p.ids for p in prompts for _ in range(opts.samples_per_prompt)]
    sampling = [
        dict(sp, sampling_seed=cfg.train.seed * 1000 + i) if r.temperature > 0 else dict(sp)
        for i in range(len(prompt_ids))
    ]
    generator = engines[0][0]
    moe = cfg.model.is_moe
    # a truncated sampling distribution (top-p < 1 / top-k): also the behaviour-policy rows
    truncated = r.temperature > 0 and (r.top_p < 1.0 or r.top_k > 0)
    generated = generator.generate(prompt_ids, sampling, mask=truncated, routing=moe and opts.routing_replay)
    keep = [i for i, g in enumerate(generated) if g.ids]
    prompt_ids = [prompt_ids[i] for i in keep]
    generated = [generated[i] for i in keep]
    responses = [g.ids for g in generated]
    sampled_lp = [g.logp for g in generated]
    owners = [p for p in prompts for _ in range(opts.samples_per_prompt)]
    owners = [owners[i] for i in keep]
    samples = [
        Sample(prompt=o, group=o.index, response_ids=g.ids, rollout_logp=g.logp, policy_version=1, finish_reason="stop")
        for o, g in zip(owners, generated)
    ]
    rcfg = copy.deepcopy(cfg)
    rcfg.algorithm.routing_replay = "r3" if moe else "none"  # replay only when asked per call
    learner = Learner(rcfg, run.chunks, run.optimizer, None, run.tokenizer.pad_id)
    learner.temperature = 1.0
    width = max(len(x) for x in responses)
    logp, _ = learner.token_logprobs(samples, width)
    trainer = [logp[i, : len(resp)].tolist() for i, resp in enumerate(responses)]

    results: list[EngineParity] = []
    single_rank = run.world == 1 and len(run.chunks) == 1 and cfg.model.section(AttnResKeys).attn_res == "none"
    for j, (scorer, _pool) in enumerate(engines):
        t0 = time.perf_counter()
        scored, routes = scorer.score(prompt_ids, responses, routing=moe and opts.routing_replay)
        flat_t = [x for row in trainer for x in row]
        flat_e = [x for row in scored for x in row]
        m = token_mismatch(flat_t, flat_e)
        res = EngineParity(
            scorer.name,
            len(flat_t),
            m["mean_abs"],
            m["p99_abs"],
            m["max_abs"],
            m["k3"],
            position_bins(trainer, scored, opts.position_bins),
        )
        if j == 0 and r.temperature == 1.0:  # sampled log-probs are temperature-scaled otherwise
            s = [x for row in sampled_lp for x in row]
            res.scoring_vs_sampling = float((torch.tensor(s) - torch.tensor(flat_e)).abs().mean())
        if opts.layers and single_rank and isinstance(scorer, EmbeddedScorer):
            res.layer_rel_diff, res.routing_disagreement = layer_report(
                scorer, run.chunks, list(zip(prompt_ids, responses))
            )
        if routes is not None:  # the trainer on the same tokens, replaying this engine's experts
            for smp, rt in zip(samples, routes):
                smp.routed_experts = compact_routing(rt)
            from mcore_rl.train import routing_replay  # lazy: megatron

            lp_r3, _, _ = learner.token_stats(samples, width, routing=learner.replay_routing(samples))
            routing_replay.clear(learner.replay_taps)  # later forwards route naturally again
            m3 = token_mismatch([x for i, resp in enumerate(responses) for x in lp_r3[i, : len(resp)].tolist()], flat_e)
            res.r3_mean_abs, res.r3_k3 = m3["mean_abs"], m3["k3"]
        res.seconds = time.perf_counter() - t0
        results.append(res)
    behaviour = (
        behaviour_rows(learner, samples, generated, width, r.temperature, moe and opts.routing_replay)
        if truncated
        else []
    )
    for _, to_close in engines:
        if to_close is not None:
            to_close.close()
    return {
        "recipe_model": config_to_dict(cfg.model),
        "num_sequences": len(responses),
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "engines": [asdict(x) for x in results],
        "behaviour_engine": generator.name,
        "behaviour": behaviour,
    }


def behaviour_rows(
    learner: Any, samples: list[Sample], generated: list[Sampled], width: int, temperature: float, routing: bool
) -> list[dict[str, Any]]:
    """The mismatch against the distribution the tokens were actually drawn from: μ = the
    generating engine's processed log-probs (after temperature and the top-p / top-k mask,
    renormalised), and π the trainer's at the sampling temperature — over the full vocabulary (what
    a trainer without sampling-mask replay computes), over the same support (replay), and each
    with the engine's experts replayed (R3) for MoE."""
    from mcore_rl.runtime.rollout_manager import flat_masks  # lazy: numpy
    from mcore_rl.train import routing_replay  # lazy: megatron

    for smp, g in zip(samples, generated):
        assert g.masks is not None and g.processed_logp is not None  # asked for with every generation here
        smp.sampling_mask_ids, smp.sampling_mask_counts = flat_masks(g.masks)
        smp.routed_experts = compact_routing(g.routed) if routing else None
    mu = [x for g in generated for x in (g.processed_logp or [])]  # (all present: asserted above)
    saved = learner.temperature
    learner.temperature = temperature
    rows = []
    try:
        for name, masked, r3 in (
            ("full vocabulary", False, False),
            ("R3", False, True),
            ("sampling mask", True, False),
            ("R3 + sampling mask", True, True),
        ):
            if r3 and not routing:
                continue
            lp, _, _ = learner.token_stats(
                samples, width, sampling_masks=masked, routing=learner.replay_routing(samples) if r3 else None
            )
            routing_replay.clear(learner.replay_taps)
            pi = [x for i, smp in enumerate(samples) for x in lp[i, : len(smp.response_ids)].tolist()]
            rows.append({"trainer": name, **token_mismatch(pi, mu)})
    finally:
        learner.temperature = saved
    return rows


def format_report(report: dict[str, Any]) -> str:
    """The terminal table of `run_parity`'s result."""
    lines = [
        f"{report['num_sequences']} sequences sampled at T={report['temperature']} "
        f"(top_p={report['top_p']}, top_k={report['top_k']}); scored at T=1; d = log π_trainer − log μ_engine",
        "",
        f"{'engine':<28}{'tokens':>8}{'mean|d|':>11}{'p99|d|':>11}{'max|d|':>11}{'K3':>11}{'score≈sample':>14}"
        f"{'R3 mean|d|':>12}{'R3 K3':>11}",
    ]
    for e in report["engines"]:
        sv = e["scoring_vs_sampling"]
        r3 = f"{e['r3_mean_abs']:>12.2e}{e['r3_k3']:>11.2e}" if e.get("r3_k3") is not None else f"{'–':>12}{'–':>11}"
        lines.append(
            f"{e['engine']:<28}{e['tokens']:>8}{e['mean_abs']:>11.2e}{e['p99_abs']:>11.2e}"
            f"{e['max_abs']:>11.2e}{e['k3']:>11.2e}{(f'{sv:.1e}' if sv is not None else '–'):>14}{r3}"
        )
    if report.get("behaviour"):
        lines += [
            "",
            f"against the sampling distribution ({report['behaviour_engine']}'s processed log-probs: after temperature "
            "and the top-p/top-k mask, renormalised), π at the sampling temperature:",
            f"  {'trainer computes π over':<26}{'mean|d|':>11}{'p99|d|':>11}{'max|d|':>11}{'K3':>11}",
        ]
        for b in report["behaviour"]:
            lines.append(
                f"  {b['trainer']:<26}{b['mean_abs']:>11.2e}{b['p99_abs']:>11.2e}{b['max_abs']:>11.2e}{b['k3']:>11.2e}"
            )
    lines += ["", "by response position (mean|d| / K3):"]
    for e in report["engines"]:
        cells = [f"[{b['start']},{b['end']}) {b['mean_abs']:.1e}/{b['k3']:.1e}" for b in e["by_position"]]
        lines.append(f"  {e['engine']:<10} " + "  ".join(cells))
    if any(e["layer_rel_diff"] for e in report["engines"]):
        lines += [
            "",
            "by layer: relative hidden-state difference ‖h_e − h_t‖/‖h_t‖ (last = final norm)"
            " and MoE routing disagreement (top-k sets differ)",
        ]
        for e in report["engines"]:
            if not e["layer_rel_diff"]:
                continue
            lines.append(f"  {e['engine']:<10} hidden  " + " ".join(f"{x:.1e}" for x in e["layer_rel_diff"]))
            rd = e["routing_disagreement"] or []
            if any(x is not None for x in rd):
                lines.append(f"  {'':<10} routing " + " ".join("   –   " if x is None else f"{x:7.2%}" for x in rd))
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
