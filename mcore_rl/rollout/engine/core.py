"""The embedded engine's synchronous core: continuous batching over the reference model.

`EngineCore` owns one model, one bounded KV pool and a queue. Each `step()` runs one decode token
for every running request (one batched forward), then admits waiting requests into free slots with
one batched prefill; requests join and leave the running batch between steps.

Memory (SGLang's scheduler): the KV pool holds `max_total_num_tokens` tokens (`--max-total-tokens`,
else `--mem-fraction-static` of the device's memory minus the weights; `kv_cache.pool_tokens`),
handed out a page at a time. A request is admitted only when the pages of its prompt are free
(beside one page of headroom per running request), in arrival order; when a decode step finds too
few pages, the most recently arrived running requests are retracted (their pages freed; they come
back first, prefilled again) until the rest fit. As in SGLang, a request's length is capped by the
pool as by the context: a prompt of `min(context_length, max_total_num_tokens)` tokens or more is
refused, and `max_new_tokens` is clamped to what is left, so every request fits alone and the
oldest running one always makes progress. No HTTP here: the async
wrapper and the SGLang-compatible server sit on top (`mcore_rl.rollout.engine.driver`, `.server`).

Semantics follow SGLang's `/generate` (field names, finish reasons, log-prob lists) with these
documented choices:

* Log-probs are those of the *raw* model distribution: `log_softmax(logits)` in fp32, before
  temperature, top-k/top-p/min-p and the `min_new_tokens` mask — what SGLang returns with
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, the setting RL trainers use (slime sets it), because that is
  the distribution the trainer recomputes. SGLang's plain default is `log_softmax(logits / T)`;
  `return_original_logprob=False` gives that instead.
* Penalties and `logit_bias` (SGLang's logit processors, `sampling.penalize`) and the
  `min_new_tokens` mask change the logits before temperature and the filters; greedy rows take the
  argmax of those processed logits, as in SGLang. Raw log-probs (below) stay the model's.
* `logprobs_mode` (engine-wide, `mcore-rl serve --logprobs-mode`, reported by `/get_server_info`):
  "raw" (the default) is the bullet above; "processed" makes `output_token_logprobs` the log-prob of
  each sampled token under the distribution it was drawn from — after the penalties, `logit_bias`,
  the `min_new_tokens` mask, temperature, top-k, top-p and min-p, renormalised: log(w_y / Σ w) of
  the sampler's weights w (0 for greedy rows). Prompt log-probs, top log-probs and
  `token_ids_logprob` stay raw in both modes.
* `return_sampling_mask` (SGLang's name) returns per output token the support S = {i : w_i > 0} of
  those weights (`output_token_sampling_mask`, ascending ids, the sampled id among them; a greedy
  row's S is {the token}) and log(w_y / Σ w) (`output_token_sampling_logprobs`), both read off the
  tensor the draw used. A request whose support could be the whole vocabulary (temperature > 0,
  top_k -1, top_p 1) is refused, as is a top_k above `sampling_mask_max_tokens` (SGLang's
  `--sampling-mask-max-tokens`); a top-p / min-p support that turns out larger than that cap finishes
  the request with finish_reason abort (the message names the cap), without the token. So is a
  request with a penalty or a logit bias: a trainer's replay renormalises its own log-probs over S and
  cannot reproduce those offsets.
* `input_token_logprobs` is aligned with `input_ids[start:]` and its first entry is always None,
  exactly as SGLang pads it; `logprob_start_len=-1` means `start = len(input_ids) - 1` (so one
  `(None, last_prompt_id)` entry), as SGLang normalises it.
* `output_ids` keep the matched stop/eos token; `text` trims it (and a matched stop string) unless
  `no_stop_trim`, like SGLang's detokenizer.
* A request's tokens do not depend on its batch mates: its random numbers come from its own seeded
  generator and every per-row computation is row-local (fp32 logits agree with a solo run to
  float rounding).
* Finishing follows SGLang's `Req.check_finished`: length first, then eos / `stop_token_ids` (both
  off with `ignore_eos`), then stop strings, then `stop_regex` (`re.search` in the decoded tail;
  finish_reason `{"type": "stop", "matched": <the pattern>}`, and the text is trimmed only where the
  pattern occurs literally, as SGLang's detokenizer trims); `min_new_tokens` masks eos and stop
  tokens before that.
* `max_new_tokens` is clamped to `min(context_length, max_total_num_tokens) - len(input_ids)`
  (SGLang's scheduler does the same; its HTTP front end, `rollout/protocol.py` here, refuses an
  explicit `max_new_tokens` that does not fit the context); a prompt of that many tokens or more
  is rejected.
* Every output token records the weight version it was sampled under
  (`RequestOutput.output_token_weight_versions`, an extension SGLang does not have): a request that
  was paused across a weight update (a partial rollout) has the old version on its early tokens and
  the new one on the later ones. No token is ever computed from K/V of other weights than its own:
  `retract()` sends running requests back to the queue without their cache (SGLang's "retract":
  re-admitted with prompt + tokens so far as one prefill); a request left in its slot across a
  weight load gets its K/V recomputed under the new weights before its next decode step
  (`_recompute_stale`). There is no prefix cache, so nothing else holds K/V.
* `Request.return_routed_experts` (SGLang's, for MoE routing replay): `RequestOutput.routed_experts`
  is int32 [len(input_ids) + len(output_ids) - 1, layers, k], the experts every forwarded token went
  to in every layer (-1 for dense layers), token-major as SGLang returns them. A retracted request's
  re-prefill and a stale recompute overwrite the rows they recompute, so the routing is always that
  of the K/V the request's later tokens read.
* `release_memory` / `resume_memory` are SGLang's `release_memory_occupation` and
  `resume_memory_occupation`: "kv_cache" frees the KV cache, "weights" frees the weights' storage
  (their values are lost, as in SGLang without `--enable-weights-cpu-backup`: after a resume they
  are zero until a weight update loads new ones, `weights_need_reload`), "cuda_graph" has nothing
  to free here. Only while idle.
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mcore_rl.data.tokenizer import DEFAULT_VOCAB_SIZE, load_tokenizer
from mcore_rl.data.tokenizer_match import has_tokenizer
from mcore_rl.hf.rope import rope_scaling_of

from .drafts import BlockDrafter, Draft, Drafter, ModelDrafter, MTPDrafter, NgramDrafter
from .fp8 import FP8_DTYPE, SCALE_SUFFIX, Fp8Linear, quantize_model_fp8
from .kv_cache import pool_tokens
from .model_runner import ModelRunner
from .sampling import (
    BatchSampling,
    RequestRandom,
    SamplingParams,
    mask_replay_conflict,
    penalize,
    regex_tail_tokens,
    SampledSupport,
    sample,
    sample_with_support,
    support_of,
)
from .spec_confidence import ConfidenceHead, draft_features
from .spec_schedule import EXPLORE_AFTER, AcceptanceRate, StepCost, prefix_survival, schedule_lengths
from .speculative import NO_DRAFT, SpeculativeSettings, verify_position
from mcore_rl.hf import OWN_MODEL_TYPES, McoreRLForCausalLM, hf_config_from_model_config, model_config_from_hf_config
from mcore_rl.hf.configuration import unsupported_stock_fields
from mcore_rl.hf.mtp import heads_name_of_nextn_layer
from mcore_rl.hf.refused_architectures import refusal
from mcore_rl.hf.rope import rope_key_in_file

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
QUANTIZATIONS = (None, "fp8")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
LOGPROBS_MODES = ("raw", "processed")
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 16384  # largest support returned per token (SGLang's --sampling-mask-max-tokens)


@dataclass
class Request:
    """One generation (or scoring) request, SGLang `GenerateReqInput` fields for a single prompt."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # SGLang: -1 -> len(input_ids) - 1; input log-probs from here
    stream: bool = False
    # SGLang's token_ids_logprob: the log-probs of these ids (in this order) at every scored position
    token_ids_logprob: list[int] | None = None
    # routing replay (SGLang's return_routed_experts): the experts of every MoE layer per token
    return_routed_experts: bool = False
    # sampling-mask replay (SGLang's return_sampling_mask): the support and processed log-prob per output token
    return_sampling_mask: bool = False


@dataclass
class RequestOutput:
    """A request's state after a step: every step for `stream` requests, and always a final one."""

    rid: str
    output_ids: list[int]  # all generated tokens so far (a matched stop/eos token included)
    finished: bool
    finish_reason: (
        dict | None
    )  # {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | {"type": "abort", "message": str}
    prompt_tokens: int
    completion_tokens: int
    output_token_logprobs: list[tuple[float, int]]  # (logprob, token_id) per generated token
    output_top_logprobs: list[list[tuple[float, int]]]  # per generated token, top_logprobs_num pairs
    input_token_logprobs: list[tuple[float | None, int]]  # input_ids[start:]; the first is None
    input_top_logprobs: list[list[tuple[float, int]] | None]  # the first is None
    weight_version: int | str  # an int, or the string a weight update named (SGLang's versions are strings)
    output_token_weight_versions: list[int | str]  # per generated token: the weight version that sampled it
    text: str | None = None  # decoded output (stop-trimmed when finished); None for non-final, non-stream
    # with Request.token_ids_logprob: (logprob, id) of each of those ids, per generated token / per
    # input position (aligned with input_token_logprobs, the first None)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # routing replay, with Request.return_routed_experts: int32 [len(input_ids) + len(output_ids) - 1,
    # num_hidden_layers, num_experts_per_tok], the experts each forwarded token went to in each layer
    # (-1 for dense layers), as SGLang's meta_info["routed_experts"] decodes; None if nothing ran
    routed_experts: Any = None
    # sampling-mask replay (with Request.return_sampling_mask): per generated token, the ids of the support
    # the token was drawn from, and log(w_y / sum w) under those post-filter weights
    output_token_sampling_mask: list[list[int]] = field(default_factory=list)
    output_token_sampling_logprobs: list[float] = field(default_factory=list)


@dataclass
class _Live:
    """Engine-side state of an admitted request."""

    req: Request
    max_new: int
    rand: RequestRandom
    stop_ids: frozenset[int]
    stop_window: int  # tokens to decode when checking stop strings
    arrival: int  # admission order (the newest are retracted first when the KV pool runs out)
    regex_window: int = 0  # tokens to decode when checking stop_regex patterns
    length: int = 0  # tokens whose K/V are in the cache
    kv_epoch: int = 0  # the `EngineCore.weights_epoch` its cached K/V were computed under
    output_ids: list[int] = field(default_factory=list)
    out_versions: list[int | str] = field(default_factory=list)
    out_lp: list[tuple[float, int]] = field(default_factory=list)
    out_top: list[list[tuple[float, int]]] = field(default_factory=list)
    in_lp: list[tuple[float | None, int]] = field(default_factory=list)
    in_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    out_tid: list[list[tuple[float, int]]] = field(default_factory=list)  # token_ids_logprob per output token
    in_tid: list[list[tuple[float, int]] | None] = field(default_factory=list)  # ... per input position
    routing: torch.Tensor | None = None  # return_routed_experts: [>= positions forwarded, layers, k] int32
    out_mask: list[list[int]] = field(default_factory=list)  # sampling-mask replay: support per output token
    out_mask_lp: list[float] = field(default_factory=list)  # ... and the processed log-prob
    draft_budget: int = 0  # speculative decoding: tokens it may draft this step (its pages are reserved)
    drafts_reached: int = 0  # ... drafts verified with every earlier draft of their pass accepted
    drafts_accepted: int = 0  # ... of those, accepted (its confidence under DSpark's schedule: `_schedule`)
    steps_unverified: int = (
        0  # ... steps since its drafts were last verified (the schedule explores after EXPLORE_AFTER)
    )

    @property
    def sp(self) -> SamplingParams:
        return self.req.sampling

    @property
    def sequence(self) -> list[int]:
        """Prompt and every token generated so far."""
        return self.req.input_ids + self.output_ids


class EngineCore:
    """Continuous-batching inference over a `McoreRLForCausalLM`; all methods are thread-safe
    (one lock: a step, a weight load, an add or an abort never interleave)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_running_requests: int = 64,
        context_length: int | None = None,
        quantization: str | None = None,
        dtype: str = "float32",
        random_seed: int = 0,
        device: str | torch.device | None = None,
        max_prefill_tokens: int = 16384,
        return_original_logprob: bool = True,
        model_path: str | None = None,
        logprobs_mode: str = "raw",
        sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS,
        max_total_tokens: int | None = None,
        mem_fraction_static: float | None = None,
        speculative: SpeculativeSettings | None = None,
        draft_model: nn.Module | None = None,
    ) -> None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: {quantization!r} is not supported (choose from {list(QUANTIZATIONS)})")
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests: must be >= 1, got {max_running_requests}")
        if context_length is None:  # SGLang's default: the model's own (get_context_length)
            context_length = default_context_length(model.config)
        if context_length < 2:
            raise ValueError(f"context_length: must be >= 2, got {context_length}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: {logprobs_mode!r} is not one of {list(LOGPROBS_MODES)}")
        if (
            isinstance(sampling_mask_max_tokens, bool)
            or not isinstance(sampling_mask_max_tokens, int)
            or sampling_mask_max_tokens < 1
        ):
            raise ValueError(f"sampling_mask_max_tokens: must be an integer >= 1, got {sampling_mask_max_tokens!r}")
        self.logprobs_mode = logprobs_mode
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self.dtype = _resolve_dtype(dtype, model)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.quantization = quantization
        self.context_length = context_length
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.return_original_logprob = return_original_logprob
        self.model_path = model_path
        self.tokenizer_path: str | None = None  # None = the bundled byte tokenizer (or given in-process)
        config: Any = model.config  # the HF config: its keys are dynamic attributes
        self.config = config
        # What /get_model_info reports: the source checkpoint's HF model_type and architectures.
        self.hf_model_type: str | None = getattr(config, "model_type", None)
        self.hf_architectures: list[str] | None = [type(model).__name__]
        self.vocab_size: int = config.vocab_size
        self.tokenizer = tokenizer
        self.weight_version: int | str = 0

        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.fp8_layers: dict[str, Fp8Linear] = {}
        if quantization == "fp8":
            names = quantize_model_fp8(self.model, self.dtype)
            self.fp8_layers = {n: m for n in names if isinstance(m := self.model.get_submodule(n), Fp8Linear)}
        self.runner = ModelRunner(self.model, max_running_requests, context_length, self.dtype, self.device)
        cache = self.runner.allocate_cache(
            pool_tokens(
                max_total_tokens=max_total_tokens,
                mem_fraction_static=mem_fraction_static,
                device=self.device,
                weight_bytes=_weight_bytes(self.model),
                bytes_per_token=self.runner.kv_bytes_per_token,
            )
        )
        self.max_total_num_tokens = cache.capacity  # SGLang's name (`/get_server_info`)
        self.max_req_len = min(context_length, cache.capacity)  # prompt + output tokens of one request

        self.eos_token_ids = _eos_ids(tokenizer, model)
        self._seed_rng = torch.Generator().manual_seed(random_seed)
        self._lock = threading.RLock()
        self._waiting: deque[Request] = deque()
        self._retracted: deque[_Live] = deque()  # out of their slots, no KV; admitted before _waiting
        self._running: list[_Live] = []  # index == KV slot
        self._pending: list[RequestOutput] = []  # aborted outputs, delivered by the next step
        self._rids: set[str] = set()
        self._controls: BatchSampling | None = None  # of the running batch; None = rebuild
        self.kv_cache_released = False
        self._released_weights: list[tuple[torch.UntypedStorage, int]] | None = None
        self._swapped_weights: list[tuple[torch.Tensor, torch.Size]] = []
        self.weights_need_reload = False  # resumed after a release: zero until a weight update
        self.weights_epoch = 0  # bumped by every weight change; K/V of an older epoch is stale
        self.recomputed_tokens = 0  # K/V computed again: retracted re-prefills and stale recomputes
        self.retracted_for_room = 0  # requests retracted because decode ran out of KV pages
        self._arrivals = 0  # admission order: who is retracted first when the pool runs out
        self.speculative = speculative
        self.drafter: Drafter | None = None
        # speculative decoding's counters: target passes that verified drafts, requests in them, tokens
        # drafted, drafts accepted, tokens emitted by those passes (accepted + the residual's or bonus)
        self.spec_stats = {"verify_passes": 0, "rows_verified": 0, "drafted": 0, "accepted": 0, "emitted": 0}
        # DSpark's schedule (`speculative.schedule: dspark`): the target's pass times, SPS(B) fitted to
        # them (`schedule_sps` overrides the fit: a profiled table, or a test's), the engine's acceptance
        self.spec_cost = StepCost()
        self.schedule_sps: Callable[[int], float] | None = None
        self.spec_acceptance = AcceptanceRate()
        self.spec_stats["cut"] = 0  # drafts the schedule did not verify
        # DSpark's trained confidence head (`spec_confidence.py`): the schedule reads its c_{r,i} instead
        # of the request's acceptance so far; `spec_log` (a list) collects what trains it: per reached
        # draft its features, whether it was accepted and its acceptance probability
        self.confidence_head: ConfidenceHead | None = None
        self.spec_log: list[tuple[torch.Tensor, bool, float]] | None = None
        if speculative is not None:
            self.drafter = self._build_drafter(speculative, draft_model)
            if speculative.confidence_head:
                self.confidence_head = ConfidenceHead.load(speculative.confidence_head)

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_model_path(
        cls, path: str | None, *, tokenizer_path: str | None = None, load_format: str = "auto", **kw: Any
    ) -> EngineCore:
        """None -> the built-in demo model (`ModelConfig()` defaults, initialised with
        `random_seed`, bundled byte tokenizer); a path -> an HF-format directory (config.json +
        *.safetensors) of our `model_type: mcore_rl` (every architecture: MoE, LatentMoE, AttnRes, n-gram
        embeddings, no QK-norm) or stock `qwen3` / `qwen3_moe` / `llama` / `qwen2` / `qwen2_moe` /
        `mistral`. `load_format="dummy"` (SGLang's name) keeps the random initialisation and reads no
        weight file: config.json is all the directory needs, and a weight update brings the real weights."""
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format: {load_format!r} is not one of auto, safetensors, dummy")

        seed = kw.get("random_seed", 0)
        spec = kw.get("speculative")
        if spec is not None and spec.algorithm == "STANDALONE" and kw.get("draft_model") is None:
            if not spec.draft_model_path:
                raise ValueError("speculative_draft_model_path: STANDALONE speculative decoding needs a draft model")
            kw["draft_model"] = load_draft_model(spec.draft_model_path)
        if path is None:
            from mcore_rl.config.schema import ModelConfig  # lazy: yaml

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = McoreRLForCausalLM(hf_config_from_model_config(ModelConfig()))
            engine = cls(model, load_tokenizer(tokenizer_path), **kw)
            engine.tokenizer_path = tokenizer_path
            return engine
        config = _load_config(path)
        carried = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if spec is not None and spec.algorithm == "NEXTN" and carried and not getattr(config, "mtp_num_layers", 0):
            config.mtp_num_layers = carried  # DeepSeek's own MTP layers draft: built as heads, loaded by name
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = McoreRLForCausalLM(config)
        engine_tokenizer_path: str | None
        if tokenizer_path is not None:
            tokenizer, engine_tokenizer_path = load_tokenizer(tokenizer_path), tokenizer_path
        else:
            tokenizer, engine_tokenizer_path = load_path_tokenizer(path, config.vocab_size)
        engine = cls(model, tokenizer, model_path=path, **kw)
        engine.tokenizer_path = engine_tokenizer_path
        engine.hf_model_type, engine.hf_architectures = _source_model_type(path)
        if load_format != "dummy":
            engine.load_safetensors_dir(path, strict=True)
        return engine

    def load_safetensors_dir(self, path: str, strict: bool = False) -> list[str]:
        """Load every *.safetensors file in `path` (one file at a time); returns the names loaded.
        With strict, every model weight must be among them."""
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"model_path: no *.safetensors files in {path}")
        loaded: list[str] = []
        layers, depths = self.config.num_hidden_layers, int(getattr(self.config, "mtp_num_layers", 0) or 0)
        carried = int(getattr(self.config, "num_nextn_predict_layers", 0) or 0)
        for f in files:
            with safe_open(f, framework="pt") as sf:
                named = []
                for n in sf.keys():  # DeepSeek's MTP layers: the heads where built (NEXTN), else not served
                    ours = heads_name_of_nextn_layer(n, layers, carried) if carried else n
                    if ours == n or (ours is not None and depths):
                        named.append((ours, n))
                loaded += self.load_weights((ours, sf.get_tensor(n)) for ours, n in named)
        if strict:
            missing = sorted(n for n in set(self.weight_names()) - set(loaded) if not n.endswith(SCALE_SUFFIX))
            if missing:
                raise ValueError(f"model_path: {path} lacks weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return loaded

    def _build_drafter(self, spec: SpeculativeSettings, draft_model: nn.Module | None) -> Drafter:
        """The drafter of `spec`, refusing what the engine cannot verify (checked before any request)."""
        spec.check()
        if self.runner.ngram_context is not None:
            raise ValueError(
                f"speculative_algorithm: {spec.algorithm} needs the multi-token verification pass, which does "
                "not cover this model's n-gram embeddings"
            )
        if spec.algorithm == "NGRAM":
            return NgramDrafter(spec.ngram_min, spec.ngram_max)
        if spec.algorithm == "NEXTN":  # the model's own MTP heads, synced with it
            return MTPDrafter(
                self.model,
                self.runner,
                num_slots=self.max_running_requests,
                max_len=self.context_length,
                max_tokens=self.max_total_num_tokens,
                dtype=self.dtype,
                device=self.device,
                vocab_size=self.vocab_size,
                weights_epoch=lambda: self.weights_epoch,
            )
        if spec.algorithm == "DFLASH":  # DSpark's block drafter, in process (its head as the draft model)
            if draft_model is None:
                raise ValueError("speculative_algorithm: DFLASH needs its dflash.BlockHead as the draft model")
            return BlockDrafter(draft_model, self.runner, vocab_size=self.vocab_size, device=self.device)
        if draft_model is None:
            raise ValueError("speculative_draft_model_path: STANDALONE speculative decoding needs a draft model")
        return ModelDrafter(
            draft_model,
            num_slots=self.max_running_requests,
            max_len=self.context_length,
            max_tokens=self.max_total_num_tokens,
            dtype=self.dtype,
            device=self.device,
            vocab_size=self.vocab_size,
        )

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request; raises ValueError naming the offending field."""
        if not isinstance(req.rid, str) or not req.rid:
            raise ValueError(f"rid: expected a non-empty string, got {req.rid!r}")
        ids = req.input_ids
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids: expected a non-empty list of token ids")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"input_ids: {t!r} is not a token id in [0, {self.vocab_size})")
        if not isinstance(req.sampling, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(req.sampling).__name__}")
        req.sampling.validate(self.context_length, len(ids), self.vocab_size)
        if len(ids) >= self.max_req_len:  # the context check above is the one users meet unless the pool is smaller
            raise ValueError(
                f"input_ids: {len(ids)} tokens cannot fit the KV cache, which holds {self.max_total_num_tokens} "
                "tokens in all (max_total_num_tokens; --max-total-tokens / --mem-fraction-static)"
            )
        for name in ("return_logprob", "stream", "return_routed_experts", "return_sampling_mask"):
            if not isinstance(getattr(req, name), bool):
                raise ValueError(f"{name}: expected a boolean, got {getattr(req, name)!r}")
        k = req.top_logprobs_num
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.vocab_size:
            raise ValueError(f"top_logprobs_num: expected an integer in [0, {self.vocab_size}], got {k!r}")
        s = req.logprob_start_len
        if isinstance(s, bool) or not isinstance(s, int) or not -1 <= s < len(ids):
            raise ValueError(f"logprob_start_len: expected -1 or an integer in [0, {len(ids)}), got {s!r}")
        tid = req.token_ids_logprob
        if tid is not None:
            if not isinstance(tid, list):
                raise ValueError(f"token_ids_logprob: expected a list of token ids, got {tid!r}")
            for t in tid:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"token_ids_logprob: {t!r} is not a token id")
                if not 0 <= t < self.vocab_size:  # SGLang's wording
                    raise ValueError(
                        f"token_ids_logprob contains out-of-vocabulary token id {t}; valid range is "
                        f"[0, {self.vocab_size})."
                    )
        if req.return_routed_experts and not self.runner.has_moe:
            raise ValueError("return_routed_experts: the served model has no MoE layers, so no experts to return")
        if req.return_sampling_mask:
            self.check_sampling_mask(req.sampling)
        with self._lock:
            if req.rid in self._rids:
                raise ValueError(duplicate_rid(req.rid))
            self._rids.add(req.rid)
            self._waiting.append(req)

    def check_sampling_mask(self, sp: SamplingParams) -> None:
        """Refuse `return_sampling_mask` where the support is unbounded or over the cap (SGLang's 400),
        or where penalties or a logit bias shift the logits (a replay could not reproduce them)."""
        if sp.processes_logits:
            raise ValueError(mask_replay_conflict(sp))
        if sp.is_greedy:
            return
        if sp.top_k == -1 and sp.top_p >= 1.0:
            raise ValueError(
                "return_sampling_mask: the support would be the whole vocabulary (temperature > 0, top_k -1, "
                "top_p 1); set sampling_params.top_k or sampling_params.top_p < 1"
            )
        if sp.top_k > self.sampling_mask_max_tokens:
            raise ValueError(
                f"return_sampling_mask: sampling_params.top_k={sp.top_k} exceeds the engine's "
                f"sampling_mask_max_tokens={self.sampling_mask_max_tokens} (--sampling-mask-max-tokens)"
            )

    def abort(self, rid: str, message: str = "Aborted by request") -> None:
        """Finish `rid` now with finish_reason abort (its final output comes with the next step);
        unknown or already finished rids are ignored, as SGLang does."""
        with self._lock:
            for req in self._waiting:
                if req.rid == rid:
                    self._waiting.remove(req)
                    self._rids.discard(rid)
                    self._pending.append(self._aborted(req, [], message))
                    return
            for live in self._retracted:
                if live.req.rid == rid:
                    self._retracted.remove(live)
                    self._rids.discard(rid)
                    self._pending.append(self._output(live, {"type": "abort", "message": message}))
                    return
            for i, live in enumerate(self._running):
                if live.req.rid == rid:
                    self._pending.append(self._output(live, {"type": "abort", "message": message}))
                    self._remove([i])
                    return

    def abort_all(self, message: str = "Aborted by request") -> None:
        with self._lock:
            for rid in [r.rid for r in self._waiting] + [live.req.rid for live in [*self._retracted, *self._running]]:
                self.abort(rid, message)

    def retract(self) -> int:
        """SGLang's retract: every running request leaves its slot and its K/V (the slots are free)
        and waits, ahead of new requests, to be prefilled again with prompt + tokens so far; its
        outputs and random stream carry on. Returns how many were retracted."""
        with self._lock:
            n = len(self._running)
            for slot in range(n):
                self.runner.kv.free(slot)
            if self.drafter is not None:
                self.drafter.reset()
            self._retracted.extend(self._running)
            self._retracted = deque(sorted(self._retracted, key=lambda live: live.arrival))
            self._running = []
            self._controls = None
            return n

    def _retract_newest(self) -> None:
        """Retract the running request that arrived last (its pages go back to the pool)."""
        slot = max(range(len(self._running)), key=lambda i: self._running[i].arrival)
        live = self._running[slot]
        self._vacate(slot)
        self._retracted.append(live)
        self._retracted = deque(sorted(self._retracted, key=lambda x: x.arrival))
        self.retracted_for_room += 1

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._retracted or self._running or self._pending)

    @property
    def _idle(self) -> bool:
        return not (self._waiting or self._retracted or self._running)

    @property
    def num_running_reqs(self) -> int:
        return len(self._running)

    @property
    def num_waiting_reqs(self) -> int:
        """Queued requests, retracted ones included."""
        return len(self._waiting) + len(self._retracted)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose K/V the running requests hold."""
        return sum(live.length for live in list(self._running))

    @property
    def num_waiting_tokens(self) -> int:
        queued = sum(len(r.input_ids) for r in list(self._waiting))
        return queued + sum(len(live.sequence) for live in list(self._retracted))

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One decode token for the running batch, then a batched prefill of admitted requests."""
        with self._lock:
            outs, self._pending = self._pending, []
            if self._running:
                self._recompute_stale()
                if self.drafter is not None:
                    self._plan_drafts()
                self._make_room()
                if any(live.draft_budget for live in self._running):
                    self._speculate(outs)
                else:
                    self._decode(outs)
            self._admit(outs)
            return outs

    def _decode(self, outs: list[RequestOutput]) -> None:
        batch = self._running
        self._routing_pass(batch)
        began = time.perf_counter()
        logits = self.runner.decode([live.output_ids[-1] for live in batch], [live.length for live in batch])
        for j, live in enumerate(batch):
            self._keep_routing(live, live.length, j, 1)
            live.length += 1
        if self._controls is None:
            self._controls = BatchSampling.of([live.sp for live in batch], self.vocab_size, self.device)
        self._emit(list(range(len(batch))), logits, self._controls, outs)
        if self._scheduled:  # the pass and its sampling: what one more position costs
            self.spec_cost.observe(len(batch), time.perf_counter() - began)

    def _plan_drafts(self) -> None:
        """How many tokens each running request may draft this step: `num_steps`, less what would
        overrun its max_new_tokens (a step emits up to the drafts + 1)."""
        assert self.speculative is not None  # only with a drafter
        k = self.speculative.num_steps
        for live in self._running:
            live.draft_budget = max(0, min(k, live.max_new - len(live.output_ids) - 1))

    def _speculate(self, outs: list[RequestOutput]) -> None:
        """One speculative step for the running batch: draft, verify every draft in one forward of
        the target over the last token and the drafts (`ModelRunner.extend`), then settle the
        positions in order with `speculative.verify_position`; a row stops at its first rejection
        (the residual's token ends it), at a finish, or after its bonus token."""
        assert self.drafter is not None  # only with a drafter
        batch = list(self._running)
        drafts: list[Draft] = self.drafter.propose(
            [live.sequence for live in batch],
            [live.draft_budget for live in batch],
            [live.sp for live in batch],
            lambda i, n: [batch[i].rand.next() for _ in range(n)],
        )
        for live in batch:
            live.draft_budget = 0
        feats = self._draft_features(batch, drafts)
        if self._scheduled:
            drafts = self._schedule(batch, drafts, feats)
        if not any(d.tokens for d in drafts):
            self._decode(outs)
            return
        base = [live.length for live in batch]
        self._routing_pass(batch)
        began = time.perf_counter()
        logits = self.runner.extend([[live.output_ids[-1], *d.tokens] for live, d in zip(batch, drafts)], base)
        self.spec_stats["verify_passes"] += 1
        self.spec_stats["rows_verified"] += len(batch)
        self.spec_stats["drafted"] += sum(len(d.tokens) for d in drafts)
        width = logits.shape[1]
        step_outs: list[RequestOutput] = []
        finished: list[int] = []
        active = list(range(len(batch)))
        for t in range(width):
            if not active:
                break
            lives = [batch[i] for i in active]
            for i, live in zip(active, lives):
                self._keep_routing(live, base[i] + t, i * width + t, 1)
                live.length = base[i] + t + 1
            proposed = [drafts[i].tokens[t] if t < len(drafts[i].tokens) else NO_DRAFT for i in active]
            ctl = BatchSampling.of([live.sp for live in lives], self.vocab_size, self.device)
            verdict: list[bool] = []
            chances: list[float] = []
            settle = self._settler(lives, [drafts[i] for i in active], t, proposed, verdict, chances)
            done = self._emit(active, logits[active, t], ctl, step_outs, pick=settle, remove=False)
            finished += done
            for i, live, x, ok, chance in zip(active, lives, proposed, verdict, chances):
                if x != NO_DRAFT:
                    live.drafts_reached += 1
                    live.drafts_accepted += int(ok)
                    self.spec_acceptance.observe(ok)
                    if self.spec_log is not None and feats is not None:
                        self.spec_log.append((feats[i][t], ok, chance))
            self.spec_stats["emitted"] += len(active)
            self.spec_stats["accepted"] += sum(verdict)
            active = [i for i, ok in zip(active, verdict) if ok and i not in done]
        if self._scheduled:  # the verification pass and the settling of its positions
            self.spec_cost.observe(sum(1 + len(d.tokens) for d in drafts), time.perf_counter() - began)
        last: dict[str, RequestOutput] = {}
        for out in step_outs:  # one output per request and step, the latest (as plain decoding streams)
            last[out.rid] = out
        outs.extend(last.values())
        self._remove(finished)

    @property
    def _scheduled(self) -> bool:
        return self.speculative is not None and self.speculative.schedule == "dspark"

    def _draft_features(self, batch: list[_Live], drafts: list[Draft]) -> list[torch.Tensor] | None:
        """The confidence head's features of every request's drafts (`spec_confidence.draft_features`),
        when a head reads them or `spec_log` records them; they read q and the past, never the drafts."""
        if self.confidence_head is None and self.spec_log is None:
            return None
        return [
            draft_features(
                d.probs,
                len(d.tokens),
                self.spec_acceptance.of(live.drafts_accepted, live.drafts_reached),
                d.match,
            )
            for live, d in zip(batch, drafts)
        ]

    def _schedule(
        self, batch: list[_Live], drafts: list[Draft], feats: list[torch.Tensor] | None = None
    ) -> list[Draft]:
        """DSpark's verify lengths (`spec_schedule.py`): each request's drafts cut to the prefix that
        maximises the expected tokens per second at this batch. Unchanged until SPS(B) is known. The
        confidence of a request's drafts is the trained head's prediction from `feats` when the engine
        has one (`spec_confidence.py`), else its own acceptance so far, shrunk to the engine's: either
        reads the past and q only, never the drafted tokens, so the cut keeps the sampling exact. A
        request cut to nothing for `EXPLORE_AFTER` steps verifies its first draft (its confidence
        would never move)."""
        sps = self.schedule_sps or self.spec_cost.sps()
        if sps is None:
            return drafts
        if self.confidence_head is not None and feats is not None:
            head = self.confidence_head
            survival = [prefix_survival(head.predict(f)) for f in feats]
        else:
            survival = [
                prefix_survival([self.spec_acceptance.of(live.drafts_accepted, live.drafts_reached)] * len(d.tokens))
                for live, d in zip(batch, drafts)
            ]
        lengths = schedule_lengths(survival, sps)
        cut: list[Draft] = []
        for live, d, n in zip(batch, drafts, lengths):
            if d.tokens and not n:  # its confidence learns only from verified drafts: one now and then
                live.steps_unverified += 1
                if live.steps_unverified >= EXPLORE_AFTER:
                    n = 1
            if n:
                live.steps_unverified = 0
            self.spec_stats["cut"] += len(d.tokens) - n
            cut.append(Draft(d.tokens[:n], d.probs[:n] if d.probs is not None and n else None, d.match))
        return cut

    def _settler(
        self,
        lives: list[_Live],
        drafts: list[Draft],
        t: int,
        proposed: list[int],
        accepted: list[bool],
        chances: list[float],
    ) -> Callable[[torch.Tensor, BatchSampling], SampledSupport]:
        """`_emit`'s draw for position t of a speculative step: each row's draft `proposed[r]`
        (`NO_DRAFT`: its bonus token) settled by rejection sampling against the processed logits
        `_emit` hands over; whether each draft was accepted is appended to `accepted`, its acceptance
        probability to `chances`."""
        vocab, dev = self.vocab_size, self.device

        def pick(masked: torch.Tensor, ctl: BatchSampling) -> SampledSupport:
            q = None
            if any(d.probs is not None for d in drafts):  # a model draft's q; point-mass rows one-hot
                q = torch.zeros(len(lives), vocab, dtype=masked.dtype, device=dev)
                for r, (d, x) in enumerate(zip(drafts, proposed)):
                    if x == NO_DRAFT:
                        continue
                    if d.probs is not None:
                        q[r] = d.probs[t].to(q.dtype)
                    else:
                        q[r, x] = 1.0
            # two uniforms per sampled row and position: the acceptance test and the draw
            u = [(live.rand.next(), live.rand.next()) if not live.sp.is_greedy else (0.0, 0.0) for live in lives]
            u_t = torch.tensor(u, dtype=torch.float64, device=dev)
            drafts_t = torch.tensor(proposed, dtype=torch.long, device=dev)
            verdict = verify_position(masked, ctl, drafts_t, q, u_t[:, 0], u_t[:, 1])
            accepted.extend(verdict.accepted.tolist())
            chances.extend(verdict.chance.tolist())
            return support_of(verdict.tokens, verdict.weights, ctl)

        return pick

    def _make_room(self) -> None:
        """Pages for every running request's next token; retract the newest arrivals until they fit."""
        cache = self.runner.kv

        def need(live: _Live) -> int:  # the next token, and the drafts it will verify with it
            return live.length + 1 + live.draft_budget

        while sum(cache.missing_pages(i, need(live)) for i, live in enumerate(self._running)) > cache.free_pages:
            self._retract_newest()
        for i, live in enumerate(self._running):
            cache.reserve(i, need(live))

    def _recompute_stale(self) -> None:
        """Slots whose K/V were computed under other weights (a weight load while they were paused
        in place) prefill prompt + output_ids[:-1] again, so the next decode step reads only K/V of
        the current weights. Consecutive stale slots share one batched prefill."""
        epoch = self.weights_epoch
        stale = [i for i, live in enumerate(self._running) if live.kv_epoch != epoch]
        runs: list[list[int]] = []  # consecutive slots whose padded batch fits max_prefill_tokens
        for i in stale:
            run = runs[-1] if runs else []
            widest = max([self._running[j].length for j in run] + [self._running[i].length])
            if run and run[-1] == i - 1 and widest * (len(run) + 1) <= self.max_prefill_tokens:
                run.append(i)
            else:
                runs.append([i])
        for run in runs:
            seqs = [self._running[i].sequence[:-1] for i in run]
            self._routing_pass([self._running[i] for i in run])
            self.runner.prefill(seqs, run[0], [])
            width = max(len(q) for q in seqs)
            for j, (i, seq) in enumerate(zip(run, seqs)):
                live = self._running[i]
                self._keep_routing(live, 0, j * width, len(seq))  # the recomputed prefix's routing replaces the old
                assert live.length == len(seq), (live.length, len(seq))
                live.kv_epoch = epoch
                self.recomputed_tokens += len(seq)

    def _admit(self, outs: list[RequestOutput]) -> None:
        """Prefill retracted requests (prompt + tokens so far) and then new ones into free slots,
        in one batch; each samples its next token from the prefill's last position."""
        free = self.max_running_requests - len(self._running)
        cache = self.runner.kv
        lives: list[_Live] = []
        longest = 0
        while (self._retracted or self._waiting) and len(lives) < free:
            n = len(self._retracted[0].sequence) if self._retracted else len(self._waiting[0].input_ids)
            if lives and max(longest, n) * (len(lives) + 1) > self.max_prefill_tokens:
                break
            slot = len(self._running) + len(lives)
            if (
                cache.missing_pages(slot, n) + slot > cache.free_pages
            ):  # its prompt, and a page of headroom per running request
                break
            cache.reserve(slot, n)
            longest = max(longest, n)
            lives.append(self._retracted.popleft() if self._retracted else self._start(self._waiting.popleft()))
        if not lives:
            return
        slot0 = len(self._running)
        resumed = [bool(live.output_ids) for live in lives]  # retracted: input log-probs are kept
        seqs = [live.sequence for live in lives]
        self._running.extend(lives)
        self._controls = None
        # Logit rows per request: the input-logprob positions (if asked) and the last token.
        rows: list[tuple[int, int]] = []
        spans: list[tuple[int, int]] = []  # (first row index, number of input-logprob rows)
        for i, (live, seq) in enumerate(zip(lives, seqs)):
            n = len(seq)
            first = len(rows)
            n_in = 0
            if live.req.return_logprob and not resumed[i]:
                start = live.req.logprob_start_len if live.req.logprob_start_len >= 0 else n - 1
                n_in = n - 1 - start  # rows start..n-2 predict tokens start+1..n-1
                rows.extend((i, p) for p in range(start, n - 1))
            rows.append((i, n - 1))
            spans.append((first, n_in))
        self._routing_pass(lives)
        logits = self.runner.prefill(seqs, slot0, rows)
        width = max(len(q) for q in seqs)
        for j, (live, seq, again) in enumerate(zip(lives, seqs, resumed)):
            self._keep_routing(live, 0, j * width, len(seq))
            live.length = len(seq)
            live.kv_epoch = self.weights_epoch
            if again:
                self.recomputed_tokens += len(seq)
        for live, (first, n_in), again in zip(lives, spans, resumed):
            if live.req.return_logprob and not again:
                self._input_logprobs(live, logits[first : first + n_in])
        last_rows = torch.tensor([first + n_in for first, n_in in spans], device=logits.device)
        slots = [slot0 + i for i in range(len(lives))]
        generating = [j for j, live in enumerate(lives) if live.max_new > 0]
        done = [slots[j] for j, live in enumerate(lives) if live.max_new == 0]
        for j in range(len(lives)):
            if lives[j].max_new == 0:
                outs.append(self._output(lives[j], {"type": "length", "length": 0}))
        if generating:
            ctl = BatchSampling.of([lives[j].sp for j in generating], self.vocab_size, self.device)
            self._emit([slots[j] for j in generating], logits[last_rows[generating]], ctl, outs, extra_done=done)
        else:
            self._remove(done)

    def _routing_pass(self, lives: list[_Live]) -> None:
        """Record the experts in the next pass iff one of its requests asked for them."""
        self.runner.record_routing(any(live.req.return_routed_experts for live in lives))

    def _keep_routing(self, live: _Live, pos: int, row: int, n: int) -> None:
        """Rows row..row+n of the last pass's routing are positions pos..pos+n of `live`."""
        got = self.runner.last_routing
        if not live.req.return_routed_experts or got is None:
            return
        end = pos + n
        buf = live.routing
        if buf is None or buf.shape[0] < end:
            grown = torch.full(
                (max(end, 2 * (0 if buf is None else buf.shape[0])), *got.shape[1:]), -1, dtype=torch.int32
            )
            if buf is not None:
                grown[: buf.shape[0]] = buf
            live.routing = buf = grown
        buf[pos:end] = got[row : row + n]

    def _start(self, req: Request) -> _Live:
        sp = req.sampling
        seed = sp.effective_seed
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, (1,), generator=self._seed_rng))
        # As in SGLang, ignore_eos turns off every token match (stop_token_ids too), not stop strings.
        stop_ids = set() if sp.ignore_eos else set(sp.stop_token_ids or []) | self.eos_token_ids
        window = 4 * max((len(s.encode()) for s in sp.stop or []), default=0) + 4
        max_new = min(sp.max_new_tokens, self.max_req_len - len(req.input_ids))
        regex_window = regex_tail_tokens(sp.stop_regex) if sp.stop_regex else 0
        self._arrivals += 1
        return _Live(
            req,
            max_new,
            RequestRandom.seeded(seed),
            frozenset(stop_ids),
            window,
            self._arrivals,
            regex_window=regex_window,
        )

    def _input_logprobs(self, live: _Live, logits: torch.Tensor) -> None:
        """SGLang's prompt log-probs: aligned with input_ids[start:], the first entry None."""
        ids = live.req.input_ids
        n = len(ids)
        start = live.req.logprob_start_len if live.req.logprob_start_len >= 0 else n - 1
        targets = ids[start + 1 :]
        live.in_lp = [(None, ids[start])]
        live.in_top = [None]
        tid = live.req.token_ids_logprob
        live.in_tid = [None] if tid is not None else []
        if not targets:
            return
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(-1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
        live.in_lp += list(zip(chosen, targets))
        if tid is not None:
            at = lp[:, torch.tensor(tid, dtype=torch.long, device=lp.device)].tolist() if tid else [[] for _ in targets]
            live.in_tid += [list(zip(row, tid)) for row in at]
        k = live.req.top_logprobs_num
        if k > 0:
            vals, idx = lp.topk(k, dim=-1)
            live.in_top += [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
        else:
            live.in_top += [[] for _ in targets]

    def _emit(
        self,
        slots: list[int],
        logits: torch.Tensor,
        ctl: BatchSampling,
        outs: list[RequestOutput],
        extra_done: list[int] | None = None,
        pick: Callable[[torch.Tensor, BatchSampling], SampledSupport] | None = None,
        remove: bool = True,
    ) -> list[int]:
        """Sample one token for each slot in `slots` (rows of `logits`), record it, finish and
        stream; then free finished slots (and `extra_done`) unless not `remove`. `pick` replaces the
        draw (speculative verification: it gets the processed logits and returns the tokens with
        their support). Returns the finished slots."""
        lives = [self._running[s] for s in slots]
        masked = self._min_new_tokens_mask(lives, logits) if ctl.any_min_new_tokens else logits
        if ctl.any_penalties:  # SGLang's logit processors, over each request's own output so far
            masked = penalize(masked, [live.sp for live in lives], [live.output_ids for live in lives])
        want_lp = [live.req.return_logprob for live in lives]
        want_mask = [live.req.return_sampling_mask for live in lives]
        processed = self.logprobs_mode == "processed" and any(want_lp)
        uniforms_t = None
        if not ctl.all_greedy and pick is None:  # argmax rows: no uniforms drawn (a greedy row never consumes one)
            uniforms = [0.0 if live.sp.is_greedy else live.rand.next() for live in lives]
            uniforms_t = torch.tensor(uniforms, dtype=torch.float64, device=logits.device)
        drawn = None
        if pick is not None:
            drawn = pick(masked, ctl)
            tokens = drawn.tokens
            drawn_lp, drawn_sizes = drawn.logprobs.tolist(), drawn.sizes.tolist()
        elif any(want_mask) or processed:  # the same draw, with the support and log(w_y / sum w) of its weights
            drawn = sample_with_support(masked, ctl, uniforms_t)
            tokens = drawn.tokens
            drawn_lp, drawn_sizes = drawn.logprobs.tolist(), drawn.sizes.tolist()
        else:
            tokens = sample(masked, ctl, uniforms_t)
        chosen = tops = None
        if any(want_lp):
            src = (
                logits
                if self.return_original_logprob
                else logits / torch.where(ctl.temperature > 0, ctl.temperature, 1.0)[:, None]
            )
            lp = torch.log_softmax(src, dim=-1)
            chosen = drawn_lp if processed else lp.gather(-1, tokens[:, None])[:, 0].tolist()
            kmax = max(live.req.top_logprobs_num for live in lives)
            if kmax > 0:
                vals, idx = lp.topk(kmax, dim=-1)
                tops = (vals.tolist(), idx.tolist())
        finished: list[int] = list(extra_done or [])
        for j, (slot, live, tok) in enumerate(zip(slots, lives, tokens.tolist())):
            if want_mask[j] and drawn_sizes[j] > self.sampling_mask_max_tokens:
                outs.append(
                    self._output(
                        live,
                        {
                            "type": "abort",
                            "message": (
                                f"return_sampling_mask: the support of output token {len(live.output_ids)} has {drawn_sizes[j]} "
                                f"ids, more than sampling_mask_max_tokens={self.sampling_mask_max_tokens} "
                                "(--sampling-mask-max-tokens); lower top_p / top_k or raise the cap"
                            ),
                        },
                    )
                )
                finished.append(slot)
                continue
            if want_mask[j]:
                assert drawn is not None  # drawn whenever a request wants its mask
                live.out_mask.append(drawn.support(j))
                live.out_mask_lp.append(drawn_lp[j])
            live.output_ids.append(tok)
            live.out_versions.append(self.weight_version)
            if want_lp[j]:
                assert chosen is not None  # computed whenever a request wants log-probs
                live.out_lp.append((chosen[j], tok))
                k = live.req.top_logprobs_num
                live.out_top.append(list(zip(tops[0][j][:k], tops[1][j][:k])) if k and tops else [])
                tid = live.req.token_ids_logprob
                if tid is not None:
                    live.out_tid.append(list(zip(lp[j, tid].tolist(), tid)) if tid else [])
            reason = self._finish_reason(live, tok)
            if reason is not None:
                outs.append(self._output(live, reason))
                finished.append(slot)
            elif live.req.stream:
                outs.append(self._output(live, None))
        if remove:
            self._remove(finished)
        return finished

    def _min_new_tokens_mask(self, lives: list[_Live], logits: torch.Tensor) -> torch.Tensor:
        rows = [j for j, live in enumerate(lives) if len(live.output_ids) < live.sp.min_new_tokens and live.stop_ids]
        if not rows:
            return logits
        masked = logits.clone()
        for j in rows:
            masked[j, list(lives[j].stop_ids)] = float("-inf")
        return masked

    def _finish_reason(self, live: _Live, tok: int) -> dict | None:
        """SGLang's `Req.check_finished` order: length, then stop tokens, then stop strings."""
        if len(live.output_ids) >= live.max_new:
            return {"type": "length", "length": live.max_new}
        if tok in live.stop_ids:
            return {"type": "stop", "matched": tok}
        if live.sp.stop:
            tail = self.tokenizer.decode(
                live.output_ids[-live.stop_window :], skip_special_tokens=live.sp.skip_special_tokens
            )
            for s in live.sp.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if live.sp.stop_regex:
            tail = self.tokenizer.decode(
                live.output_ids[-live.regex_window :], skip_special_tokens=live.sp.skip_special_tokens
            )
            for pattern in live.sp.stop_regex:
                if re.search(pattern, tail):
                    return {"type": "stop", "matched": pattern}
        return None

    def _remove(self, slots: list[int]) -> None:
        """Finish the requests in `slots` (their pages go back to the pool)."""
        for slot in sorted(set(slots), reverse=True):
            self._rids.discard(self._running[slot].req.rid)
            self._vacate(slot)

    def _vacate(self, slot: int) -> None:
        """Free a slot's pages; the last running request moves into the hole so slots stay 0..B-1."""
        last = len(self._running) - 1
        self.runner.kv.free(slot)
        if self.drafter is not None:
            self.drafter.free(slot)
        if slot != last:
            self.runner.move(last, slot)
            if self.drafter is not None:
                self.drafter.move(last, slot)
            self._running[slot] = self._running[last]
        self._running.pop()
        self._controls = None

    # ---- outputs ---------------------------------------------------------------------------

    def _output(self, live: _Live, reason: dict | None) -> RequestOutput:
        final = reason is not None
        copy = (lambda x: x) if final else list
        return RequestOutput(
            rid=live.req.rid,
            output_ids=copy(live.output_ids),
            finished=final,
            finish_reason=reason,
            prompt_tokens=len(live.req.input_ids),
            completion_tokens=len(live.output_ids),
            output_token_logprobs=copy(live.out_lp),
            output_top_logprobs=copy(live.out_top),
            input_token_logprobs=live.in_lp,
            input_top_logprobs=live.in_top,
            weight_version=self.weight_version,
            output_token_weight_versions=copy(live.out_versions),
            text=self._text(live.output_ids, live.sp, reason),
            output_token_ids_logprobs=copy(live.out_tid),
            input_token_ids_logprobs=live.in_tid,
            routed_experts=self._routed(live),
            output_token_sampling_mask=copy(live.out_mask),
            output_token_sampling_logprobs=copy(live.out_mask_lp),
        )

    @staticmethod
    def _routed(live: _Live) -> Any:
        """SGLang's routed experts: one row per forwarded token (all but the last of the sequence)."""
        if not live.req.return_routed_experts or live.routing is None:
            return None
        return live.routing[: len(live.sequence) - 1].numpy().copy()

    def _aborted(self, req: Request, output_ids: list[int], message: str) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            output_ids=output_ids,
            finished=True,
            finish_reason={"type": "abort", "message": message},
            prompt_tokens=len(req.input_ids),
            completion_tokens=0,
            output_token_logprobs=[],
            output_top_logprobs=[],
            input_token_logprobs=[],
            input_top_logprobs=[],
            weight_version=self.weight_version,
            output_token_weight_versions=[],
            text="",
        )

    def _text(self, ids: list[int], sp: SamplingParams, reason: dict | None) -> str:
        """SGLang's detokenized text: a matched stop token / stop string is trimmed unless no_stop_trim."""
        matched = (reason or {}).get("matched")
        if matched is not None and not sp.no_stop_trim and isinstance(matched, int) and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        if isinstance(matched, str) and not sp.no_stop_trim:
            pos = text.find(matched)
            text = text[:pos] if pos >= 0 else text
        return text

    # ---- weights ---------------------------------------------------------------------------

    def weight_names(self) -> list[str]:
        """HF names this engine's model takes (FP8 layers: `.weight` and `.weight_scale_inv`)."""
        names = [n for n, _ in self.model.named_parameters()]
        names += [n + ".weight_scale_inv" for n in self.fp8_layers]
        names += [n + ".weight" for n in self.fp8_layers]
        return sorted(names)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy HF-named tensors into the model (any subset, any order, in as many calls as wanted).

        FP8 engine: a full-precision `x.weight` of a quantized Linear is quantized here; an e4m3
        `x.weight` and its `x.weight_scale_inv` (SGLang checkpoint names) are taken as they are.
        Stock transformers-5 fused MoE expert tensors are split per expert. The caller bumps
        `weight_version` (the weight-update endpoints do). Returns the (per-expert) names loaded.
        """
        with self._lock:
            # parameters and persistent buffers (DeepSeek-V3 / GLM-4.5's router `e_score_correction_bias`
            # is a buffer the checkpoint and the trainer's sync carry)
            params: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
            params.update(self.model.named_parameters())
            if self.config.tie_word_embeddings:
                hf_model: Any = self.model  # a transformers PreTrainedModel (held as nn.Module)
                params.setdefault("lm_head.weight", hf_model.get_input_embeddings().weight)
            loaded: list[str] = []
            try:
                for name, tensor in _split_fused(named_tensors):
                    self._load_one(name, tensor, params)
                    loaded.append(name)
            finally:
                self.weights_epoch += 1  # even a failed load may have changed some weights
                self.runner.refresh()
            return loaded

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor]) -> None:
        if name.endswith(SCALE_SUFFIX):
            layer = self.fp8_layers.get(name[: -len(SCALE_SUFFIX)])
            if layer is None:
                raise ValueError(
                    f"{name}: FP8 scales for a layer this engine does not hold in FP8 (quantization={self.quantization})"
                )
            layer.set_quantized(scale_inv=tensor.to(self.device))
            return
        module_name = name.removesuffix(".weight")
        if name.endswith(".weight") and module_name in self.fp8_layers:
            layer = self.fp8_layers[module_name]
            if tuple(tensor.shape) != tuple(layer.weight.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != the model's {tuple(layer.weight.shape)}")
            if tensor.dtype == FP8_DTYPE:
                layer.set_quantized(q=tensor.to(self.device))
            else:
                layer.set_weight(tensor)
            return
        if name.endswith("rotary_emb.inv_freq"):  # a buffer some checkpoints carry; derived from the config
            return
        param = params.get(name)
        if param is None:
            raise ValueError(f"{name}: no such weight in the engine's model")
        if tensor.dtype == FP8_DTYPE:
            raise ValueError(f"{name}: an FP8 weight, but this engine runs quantization={self.quantization}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != the model's {tuple(param.shape)}")
        param.data.copy_(tensor.to(device=param.device, dtype=param.dtype))

    def flush_cache(self) -> bool:
        """Forget cached K/V (every weight update asks for it). Like SGLang, refuses (returns False)
        while requests are in flight. With no request in flight no slot holds anything a later
        request reads unmasked, so this keeps the allocation: freeing and reallocating it on every
        weight sync cost ~15-30 ms of page faults and the next rollout's regrowth. Memory goes back
        with `release_memory(["kv_cache"])` (SGLang's `/release_memory_occupation`)."""
        with self._lock:
            return self._idle

    # ---- memory (SGLang's release/resume_memory_occupation) ----------------------------------

    @property
    def weights_released(self) -> bool:
        return self._released_weights is not None

    @property
    def memory_held(self) -> bool:
        """True while requests cannot run: memory released, or weights not reloaded since."""
        return self.kv_cache_released or self.weights_released or self.weights_need_reload

    def not_ready_reason(self) -> str | None:
        """Why a request cannot run now (memory released, or weights zero since a resume), naming
        what brings the engine back; None when it can."""
        released = self.released_memory()
        if released:
            return (
                f"the engine's memory is released ({', '.join(released)}; /release_memory_occupation): "
                "call /resume_memory_occupation, and after a weights release update the weights, first"
            )
        if self.weights_need_reload:
            return (
                "the weights are zero since /resume_memory_occupation (a release does not keep them, as in "
                "SGLang without --enable-weights-cpu-backup): update the weights (/update_weights_from_disk, "
                "_from_tensor or _from_distributed with a weight_version) before generating"
            )
        return None

    def released_memory(self) -> list[str]:
        return [t for t, on in (("weights", self.weights_released), ("kv_cache", self.kv_cache_released)) if on]

    def release_memory(self, tags: Iterable[str]) -> None:
        """Free the memory of `tags` (see the module docstring); ValueError unless idle."""
        tags = set(tags)
        with self._lock:
            if not self._idle:
                raise ValueError(
                    "release_memory_occupation: needs an idle engine (no running or waiting requests; "
                    "abort them or pause with mode 'abort' first)"
                )
            if "kv_cache" in tags and not self.kv_cache_released:
                self.runner.kv.release()
                self.kv_cache_released = True
            if "weights" in tags and self._released_weights is None:
                names = set(self.weight_names())
                storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
                swapped: dict[int, tuple[torch.Tensor, torch.Size]] = {}
                for name, t in self.model.state_dict(keep_vars=True).items():
                    if name not in names:
                        continue
                    st = t.untyped_storage()
                    if st.resizable():
                        storages.setdefault(st.data_ptr(), (st, st.nbytes()))
                    else:  # a numpy view (zero-copy file reads) pinned it: swap the tensor's data instead
                        swapped.setdefault(id(t), (t, t.shape))
                self.runner.drop_derived()
                for st, _ in storages.values():
                    st.resize_(0)
                for t, _ in swapped.values():
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                self._released_weights = list(storages.values())
                self._swapped_weights = list(swapped.values())

    def resume_memory(self, tags: Iterable[str]) -> None:
        """Allocate the memory of `tags` again; released weights come back as zeros."""
        tags = set(tags)
        with self._lock:
            if "weights" in tags and self._released_weights is not None:
                for st, nbytes in self._released_weights:
                    st.resize_(nbytes)
                    st.fill_(0)  # type: ignore[attr-defined]  # torch's stubs omit UntypedStorage.fill_
                for t, shape in self._swapped_weights:
                    t.data = torch.zeros(shape, dtype=t.dtype, device=t.device)
                self._swapped_weights = []
                self._released_weights = None
                self.weights_need_reload = True
                self.weights_epoch += 1
                self.runner.refresh()
            if "kv_cache" in tags and self.kv_cache_released:
                self.runner.kv.allocate()
                self.kv_cache_released = False


def _weight_bytes(model: nn.Module) -> int:
    """Bytes the model's tensors occupy (shared storages counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    return sum(storages.values())


def _resolve_dtype(dtype: str, model: nn.Module) -> torch.dtype:
    if dtype == "auto":
        cfg_dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = _DTYPES.get(cfg_dtype)
        return cfg_dtype if cfg_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported (choose from {['auto', *_DTYPES]})")
    return _DTYPES[dtype]


def _eos_ids(tokenizer: Any, model: nn.Module) -> set[int]:
    ids = {int(tokenizer.eos_id)} if getattr(tokenizer, "eos_id", None) is not None else set()
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids |= {int(i) for i in extra}
    return ids


def duplicate_rid(rid: str) -> str:
    """SGLang's message for a request id already in flight (TokenizerManager)."""
    return f"rid: Duplicate request ID detected: {rid}"


def default_context_length(config: Any) -> int:
    """SGLang's `get_context_length`: the config's `max_position_embeddings` (x the factor of linear
    RoPE scaling, which SGLang applies when no `original_max_position_embeddings` is given)."""
    length = int(getattr(config, "max_position_embeddings", 0) or 2048)
    scaling = rope_scaling_of(config) or {}
    if scaling.get("rope_type") == "linear" and "original_max_position_embeddings" not in scaling:
        length = int(length * float(scaling.get("factor", 1.0)))
    return length


def _source_model_type(path: str) -> tuple[str | None, list[str] | None]:
    """`model_type` and `architectures` as the checkpoint's config.json states them (what SGLang's
    /get_model_info reports), not those of the engine's own config class."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    arch = raw.get("architectures")
    return raw.get("model_type"), list(arch) if isinstance(arch, list) else None


_STOCK_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "qwen2", "qwen2_moe", "mistral")


def _load_config(path: str):
    """Our config of an HF directory: ours (`OWN_MODEL_TYPES`) as it is; stock Qwen3 / Qwen3-MoE / Llama
    mapped through `model_config_from_hf_config` (Llama: no QK-norm), after refusing what the
    reference model cannot compute (each problem naming its `config.json` field)."""

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"model_path: {path} has no config.json")
    with open(cfg_file, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    from transformers import AutoConfig

    if model_type in OWN_MODEL_TYPES:  # mcore_rl.hf registers both with AutoConfig
        return AutoConfig.from_pretrained(path)
    if model_type in _STOCK_MODEL_TYPES:
        stock = AutoConfig.from_pretrained(path)
        rope_key = rope_key_in_file(cfg_file)
        problems = unsupported_stock_fields(stock, rope_key)
        if problems:
            raise ValueError(f"model_path: cannot serve this {model_type} checkpoint:\n  " + "\n  ".join(problems))
        config = hf_config_from_model_config(model_config_from_hf_config(stock, rope_key))
        # The reference model has q/k/v/o biases (megatron here has none, so ModelConfig drops the flag).
        config.attention_bias = bool(getattr(stock, "attention_bias", False))
        return config
    refused = refusal(model_type)
    if refused is not None:
        raise ValueError(f"model_path: {refused}")
    raise ValueError(
        f"model_path: model_type {model_type!r} is not supported by the embedded engine "
        f"(supported: {', '.join(OWN_MODEL_TYPES)}, {', '.join(_STOCK_MODEL_TYPES)})"
    )


def load_draft_model(path: str) -> nn.Module:
    """A draft model for STANDALONE speculative decoding: the reference model of the HF directory
    `path` (the kinds `EngineCore.from_model_path` serves), its weights from the directory's safetensors."""
    from safetensors import safe_open  # lazy: only a draft model's path reads files here

    config = _load_config(path)
    model = McoreRLForCausalLM(config)
    params = dict(model.named_parameters())
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"speculative_draft_model_path: no *.safetensors files in {path}")
    loaded: set[str] = set()
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name, tensor in _split_fused((n, sf.get_tensor(n)) for n in sf.keys()):
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name not in params:
                    raise ValueError(f"speculative_draft_model_path: {path}: {name} is no weight of the draft model")
                params[name].data.copy_(tensor.to(params[name].dtype))
                loaded.add(name)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = sorted(n for n in params if n not in loaded and not (tied and n == "lm_head.weight"))
    if missing:
        raise ValueError(f"speculative_draft_model_path: {path} lacks weights {missing[:8]}")
    return model


def load_path_tokenizer(path: str, vocab_size: int) -> tuple[Any, str | None]:
    """(tokenizer, its path): the checkpoint's tokenizer if it has one; else the bundled byte
    tokenizer (if the vocabulary fits) and None."""
    if os.path.isfile(path) or has_tokenizer(path):
        return load_tokenizer(path), path
    if vocab_size < DEFAULT_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer: {path} has no tokenizer and the bundled byte tokenizer needs vocab_size >= "
            f"{DEFAULT_VOCAB_SIZE} (the model has {vocab_size}); pass tokenizer_path"
        )
    return load_tokenizer(None), None


_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _split_fused(named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """transformers>=5 stock Qwen3-MoE fused experts -> per-expert checkpoint names."""
    for name, t in named:
        if name.endswith(_FUSED[0]):
            prefix = name[: -len("gate_up_proj")]
            for j in range(t.shape[0]):
                gate, up = t[j].chunk(2, dim=0)
                yield f"{prefix}{j}.gate_proj.weight", gate
                yield f"{prefix}{j}.up_proj.weight", up
        elif name.endswith(_FUSED[1]):
            prefix = name[: -len("down_proj")]
            for j in range(t.shape[0]):
                yield f"{prefix}{j}.down_proj.weight", t[j]
        else:
            yield name, t
