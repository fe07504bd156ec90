"""`mcore-rl serve` flags, spelled as `python -m sglang.launch_server` spells them.

A launch script written for SGLang should run the embedded engine by changing only the command.
Flags fall in these groups:

- **honoured**: `--model-path` (alias `--model`; none = the built-in tiny demo model),
  `--tokenizer-path`, `--host`, `--port`, `--dtype`, `--quantization fp8`, `--context-length`,
  `--load-format` (auto / safetensors read the checkpoint; `dummy`, as in SGLang, initialises the
  weights randomly from `--random-seed` and reads no weight file: for engines whose weights the
  trainer's first weight sync fills), `--device` (cpu / cuda; default: cuda when available),
  `--random-seed`, `--max-running-requests`, `--served-model-name`, `--weight-version` (any
  string, as in SGLang), `--max-total-tokens` (the KV pool's size in tokens) and
  `--mem-fraction-static` (otherwise the pool is this fraction of the device's memory less the
  weights; see `mcore_rl/rollout/engine/kv_cache.py`), `--enable-return-routed-experts` (requests may then ask for
  `return_routed_experts`: MoE routing replay), `--api-key` and `--admin-api-key` (SGLang's bearer-token checks, see
  `mcore_rl/rollout/server.py`), `--incremental-streaming-output` (old name `--stream-output`:
  streamed `/generate` chunks carry only the new `output_ids` and text), `--tool-call-parser`
  (`qwen25` / `llama3`, or our names `hermes` / `llama3_json`: how chat replies with `tools` are read;
  default: the model family's format, `mcore_rl/data/tool_calls.py`);
- **speculative decoding** (SGLang's names): `--speculative-algorithm NGRAM|STANDALONE|NEXTN` (prompt lookup, or
  a separate draft model at `--speculative-draft-model-path`, alias `--speculative-draft-model`),
  `--speculative-num-steps` (tokens drafted per verification), `--speculative-ngram-min-match-window-size`
  and `--speculative-ngram-max-match-window-size`; exact: the output distribution, log-probs, masks and
  experts are the target's (`rollout/engine/speculative.py`, docs/speculative.md); NEXTN drafts with the
  model's own MTP heads; EAGLE is refused;
- **our own**: `--logprobs-mode raw|processed` (what `output_token_logprobs` are: the raw
  full-vocabulary log-probs, or those of the processed distribution each token was drawn from —
  after temperature and the top-k/top-p/min-p mask, renormalised; see `rollout/engine/core.py`;
  `/get_server_info` reports it), `--sampling-mask-max-tokens N` (SGLang's name: the largest support
  `return_sampling_mask` returns per token), `--weight-dirs DIR ...`, the directories whose files the weight-update endpoints may
  read (`/update_weights_from_disk`'s `model_path`, a tensor file of `/update_weights_from_tensor`);
  default `default_weight_dirs(model_path)`: the model's directory, the temp dir and /dev/shm, where
  the trainer's transports write; `--weight-dirs` alone accepts no path at all;
- **accepted for compatibility**: `--tp-size`/`--tensor-parallel-size` and `--dp-size`/
  `--data-parallel-size` (only 1: the embedded engine is one process on one device),
  `--kv-cache-dtype auto`, and knobs that tune a GPU server
  without changing a token: `--chunked-prefill-size`,
  `--max-prefill-tokens`, `--cuda-graph-max-bs`, `--disable-cuda-graph`,
  `--disable-radix-cache`, `--attention-backend`, `--sampling-backend`, `--schedule-policy`,
  `--enable-memory-saver`, `--skip-server-warmup`, `--trust-remote-code`, `--log-level`,
  `--log-level-http`; they are recorded in `/get_server_info` and otherwise ignored;
- **every other flag of SGLang's server** is classified in `mcore_rl/rollout/sglang_flags.py`: the
  performance and deployment knobs are accepted, logged at start and listed under `ignored_flags`
  in `/get_server_info`; those that would change what is generated or returned are refused with a
  message naming the flag and why; a flag SGLang does not have is refused too.

Log-probs are those of the raw distribution (what SGLang returns with
`SGLANG_RETURN_ORIGINAL_LOGPROB=1`, the RL setting); with that variable set to `0` / `false` they
are those of the temperature-scaled distribution, SGLang's plain default (see
`mcore_rl/rollout/engine/core.py`).

`--context-length` defaults, as in SGLang, to the model's own (`max_position_embeddings`, see
`rollout/engine/core.py: default_context_length`).

`--dtype auto` means float32 here (SGLang picks the checkpoint's half precision on a GPU; on CPU the
embedded engine's job is to match the fp32 trainer unless asked otherwise). `--random-seed`
defaults to 0 rather than SGLang's random pick, so runs are reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mcore_rl.data.tool_calls import tool_call_format
from mcore_rl.rollout import sglang_flags

if TYPE_CHECKING:  # annotations only: the engine package loads torch and transformers
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings

DTYPES = {
    "auto": "float32",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "half": "float16",
    "float16": "float16",
}


LOAD_FORMATS = ("auto", "safetensors", "dummy")


def return_original_logprob() -> bool:
    """SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB`; unset means true here (raw log-probs)."""
    return os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "1").strip().lower() not in ("0", "false", "no", "off")


class LaunchFlagError(ValueError):
    """A flag the embedded engine cannot honour; the message names it."""


@dataclass
class ServerArgs:
    """The subset of SGLang's `ServerArgs` the embedded engine knows, with SGLang's field names."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    quantization: str | None = None
    context_length: int | None = None
    random_seed: int = 0
    max_running_requests: int | None = None
    served_model_name: str | None = None
    weight_version: str = "0"
    tp_size: int = 1
    dp_size: int = 1
    load_format: str = "auto"
    device: str | None = None  # None = cuda when available, else cpu (SGLang's auto-detection)
    kv_cache_dtype: str = "auto"
    # the KV pool (honoured by `server.build_server`)
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    # Accepted and ignored (see the module docstring).
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int | None = None
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    attention_backend: str | None = None
    sampling_backend: str | None = None
    schedule_policy: str | None = None
    enable_memory_saver: bool = False
    skip_server_warmup: bool = False
    trust_remote_code: bool = False
    log_level: str = "info"
    log_level_http: str | None = None
    # Security (SGLang's names), and the directories weight files may come from (ours).
    api_key: str | None = None
    admin_api_key: str | None = None
    weight_dirs: list[str] | None = None
    # routing replay: requests may ask for `return_routed_experts` (SGLang's flag)
    enable_return_routed_experts: bool = False
    # sampling-mask replay: what output_token_logprobs are, and the largest support returned per token
    logprobs_mode: str = "raw"
    sampling_mask_max_tokens: int = 16384
    # streamed /generate chunks carry only what is new (SGLang's --incremental-streaming-output)
    incremental_streaming_output: bool = False
    # how chat replies with `tools` are parsed (SGLang's name, or ours); None = the model family's format
    tool_call_parser: str | None = None
    # serve a reward model (a *ForSequenceClassification) on SGLang's /classify instead of generating
    is_embedding: bool = False
    # speculative decoding (SGLang's flag names; see rollout/engine/speculative.py): NGRAM or STANDALONE
    speculative_algorithm: str | None = None
    speculative_num_steps: int = 4
    speculative_draft_model_path: str | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 3
    speculative_schedule: str = "fixed"  # ours, not SGLang's: fixed k, or DSpark's confidence schedule
    speculative_confidence_head: str | None = None  # ours: DSpark's trained confidence head (JSON)
    # SGLang flags accepted and ignored (sglang_flags.IGNORED): flag -> its values as given
    ignored_flags: dict[str, list[str]] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path or "mcore-rl-demo"

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `EngineCore.from_model_path(self.model_path, **kwargs)`."""
        kw: dict[str, Any] = {
            "dtype": DTYPES[self.dtype],
            "quantization": self.quantization,
            "random_seed": self.random_seed,
            "load_format": self.load_format,
            "return_original_logprob": return_original_logprob(),
            "logprobs_mode": self.logprobs_mode,
            "sampling_mask_max_tokens": self.sampling_mask_max_tokens,
        }
        if self.device is not None:
            kw["device"] = self.device
        if self.context_length is not None:
            kw["context_length"] = self.context_length
        if self.max_running_requests is not None:
            kw["max_running_requests"] = self.max_running_requests
        if self.speculative_algorithm is not None:
            kw["speculative"] = self.speculative_settings()
        return kw

    def speculative_settings(self) -> SpeculativeSettings:
        """The engine's `SpeculativeSettings` of the `--speculative-*` flags."""
        from mcore_rl.rollout.engine.speculative import SpeculativeSettings  # lazy: torch, transformers

        return SpeculativeSettings(
            algorithm=self.speculative_algorithm or "NGRAM",
            num_steps=self.speculative_num_steps,
            draft_model_path=self.speculative_draft_model_path,
            ngram_min=self.speculative_ngram_min_match_window_size,
            ngram_max=self.speculative_ngram_max_match_window_size,
            schedule=self.speculative_schedule,
            confidence_head=self.speculative_confidence_head,
        )

    @property
    def allowed_weight_dirs(self) -> list[str]:
        """`--weight-dirs`, or the default that the trainer's transports write to."""
        return list(self.weight_dirs) if self.weight_dirs is not None else default_weight_dirs(self.model_path)

    def to_dict(self) -> dict[str, Any]:
        """For `/get_server_info`: the keys themselves are never shown, only whether they are set."""
        d = dataclasses.asdict(self)
        for key in ("api_key", "admin_api_key"):
            d[key] = "<set>" if d[key] else None
        d["weight_dirs"] = self.allowed_weight_dirs
        return d


def default_weight_dirs(model_path: str | None) -> list[str]:
    """Where weight files may come from unless `--weight-dirs` says otherwise: the served model's
    directory, the temp dir (`tempfile.gettempdir()`, where tests and the default sync dirs live)
    and /dev/shm (the tensor transport's shared-memory files). Anyone who can call the weight
    endpoints can send tensors inline anyway; the list keeps them from reading, or probing for,
    files anywhere else on the host."""
    dirs = [tempfile.gettempdir(), "/dev/shm"]
    if model_path:
        dirs.insert(0, os.path.abspath(model_path))
    return dirs


class _Parser(argparse.ArgumentParser):
    """argparse that raises `LaunchFlagError` instead of exiting, so callers choose how to report."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse types error() as NoReturn; this one raises too
        raise LaunchFlagError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mcore-rl serve",
        description="The embedded SGLang-compatible engine (SGLang's native and OpenAI HTTP APIs).",
        epilog="Other flags of SGLang's server are classified in mcore_rl/rollout/sglang_flags.py: performance "
        "and deployment knobs are accepted, logged and ignored; flags that would change what is generated "
        "or returned are refused, naming the flag.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        help="HF-format model directory (safetensors); omitted = the built-in tiny demo model",
    )
    p.add_argument("--tokenizer-path", help="tokenizer directory (default: the model's, or the bundled one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="auto = float32 here")
    p.add_argument("--quantization", help="fp8: float8 e4m3 weights with 128x128 block scales")
    p.add_argument("--context-length", type=int)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--served-model-name")
    p.add_argument("--weight-version", default="0", help="initial weight version (any string)")
    p.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", "--dp", dest="dp_size", type=int, default=1)
    p.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="dummy: random weights from --random-seed, no weight file read (a weight sync fills them)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every endpoint but /health*")
    p.add_argument(
        "--admin-api-key", help="require this key (instead of --api-key) on the weight and control endpoints"
    )
    p.add_argument(
        "--weight-dirs",
        nargs="*",
        metavar="DIR",
        help="directories weight-update requests may read files from (default: the model's "
        "directory, the temp dir, /dev/shm; the flag alone: none)",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="let /generate requests ask for return_routed_experts (MoE routing replay)",
    )
    p.add_argument(
        "--logprobs-mode",
        default="raw",
        choices=["raw", "processed"],
        help="output_token_logprobs: raw full-vocabulary log-probs (default) or those of the processed "
        "distribution the token was drawn from (after temperature and top-k/top-p/min-p, renormalised)",
    )
    p.add_argument(
        "--sampling-mask-max-tokens",
        type=int,
        default=16384,
        help="largest support return_sampling_mask returns per output token (SGLang's flag)",
    )
    p.add_argument(
        "--incremental-streaming-output",
        "--stream-output",
        dest="incremental_streaming_output",
        action="store_true",
        help="streamed /generate chunks carry only the new output_ids and text",
    )
    p.add_argument("--max-total-tokens", type=int, help="the KV cache pool's size in tokens")
    p.add_argument(
        "--is-embedding",
        action="store_true",
        help="serve --model-path as a reward model (a *ForSequenceClassification) on SGLang's /classify",
    )
    p.add_argument(
        "--tool-call-parser",
        help="the tool-call format of chat replies with tools: qwen25 (= hermes), llama3 (= llama3_json) or another "
        "format of mcore_rl/data/tool_calls.py; "
        "default: the model family's (see mcore_rl/data/tool_calls.py)",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        help="without --max-total-tokens: the pool is this fraction of the device's memory (CPU: RAM or "
        "the cgroup's limit) less the weights (default 0.88 on a GPU, 0.5 on CPU)",
    )
    spec = p.add_argument_group("speculative decoding (exact: rejection sampling against the target)")
    spec.add_argument(
        "--speculative-algorithm",
        help="NGRAM (prompt lookup, no model), STANDALONE (a separate draft model, "
        "--speculative-draft-model-path) or NEXTN (the model's own MTP heads); EAGLE is not served here",
    )
    spec.add_argument("--speculative-num-steps", type=int, default=4, help="tokens drafted per verification")
    spec.add_argument(
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        dest="speculative_draft_model_path",
        help="STANDALONE: HF directory of a draft model with the target's tokenizer",
    )
    spec.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1)
    spec.add_argument("--speculative-ngram-max-match-window-size", type=int, default=3)
    spec.add_argument(
        "--speculative-schedule",
        default="fixed",
        help="fixed (verify every draft) or dspark (per-request verify lengths from the drafts' confidence "
        "and the measured pass time at the batch size; not an SGLang flag)",
    )
    spec.add_argument(
        "--speculative-confidence-head",
        help="dspark: a trained confidence head (JSON of tools/train_confidence_head.py) in place of each "
        "request's acceptance so far (not an SGLang flag)",
    )
    ignored = p.add_argument_group("accepted for compatibility with SGLang, ignored")
    for flag, kind in [
        ("--chunked-prefill-size", int),
        ("--max-prefill-tokens", int),
        ("--cuda-graph-max-bs", int),
        ("--attention-backend", str),
        ("--sampling-backend", str),
        ("--schedule-policy", str),
    ]:
        ignored.add_argument(flag, type=kind)
    for flag in (
        "--disable-cuda-graph",
        "--disable-radix-cache",
        "--enable-memory-saver",
        "--skip-server-warmup",
        "--trust-remote-code",
    ):
        ignored.add_argument(flag, action="store_true")
    ignored.add_argument("--log-level", default="info")
    ignored.add_argument("--log-level-http")
    return p


def parse_server_args(argv: list[str]) -> ServerArgs:
    """Parse and check `mcore-rl serve` flags; `LaunchFlagError` names any flag it cannot honour.
    SGLang flags it does not honour are classified by `sglang_flags` (ignored or refused)."""
    parser = build_parser()
    ours, ignored = _split_sglang_flags(argv, set(parser._option_string_actions))
    ns, unknown = parser.parse_known_args(ours)
    if unknown:
        raise LaunchFlagError(f"{unknown[0]}: unexpected argument (mcore-rl serve takes flags only; see --help)")
    args = ServerArgs(**vars(ns), ignored_flags=ignored)
    _check(args)
    return args


def _split_sglang_flags(argv: list[str], ours: set[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(the arguments of flags this parser has, {ignored SGLang flag: its values}); a flag that
    `sglang_flags.classify` refuses raises `LaunchFlagError`. The values of a flag are the arguments
    up to the next `--flag` (or the part after `=`)."""
    kept: list[str] = []
    ignored: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        if not token.startswith("--") or flag in ours:
            kept.extend(argv[i:j])
        else:
            values = [inline] if eq else argv[i + 1 : j]
            why = sglang_flags.classify(flag, values)
            if why is not None:
                raise LaunchFlagError(why)
            ignored[flag] = values
        i = j
    return kept, ignored


def _check(a: ServerArgs) -> None:
    if a.tp_size != 1:
        raise LaunchFlagError(
            f"--tp-size {a.tp_size}: the embedded engine runs in one process on one device (only 1); "
            "use `python -m sglang.launch_server` for tensor parallelism"
        )
    if a.dp_size != 1:
        raise LaunchFlagError(
            f"--dp-size {a.dp_size}: the embedded engine is one replica (only 1); start several "
            "servers and put mcore_rl.rollout.router.EngineRouter (or sglang-router) in front"
        )
    if a.quantization not in (None, "fp8"):
        raise LaunchFlagError(f"--quantization {a.quantization}: the embedded engine supports only fp8")
    if a.load_format not in LOAD_FORMATS:
        raise LaunchFlagError(
            f"--load-format {a.load_format}: the embedded engine reads safetensors or starts "
            f"from random weights ({', '.join(LOAD_FORMATS)})"
        )
    if a.kv_cache_dtype != "auto":
        raise LaunchFlagError(
            f"--kv-cache-dtype {a.kv_cache_dtype}: the embedded engine keeps the KV cache in the model dtype (auto)"
        )
    if not 0 <= a.port <= 65535:
        raise LaunchFlagError(f"--port {a.port}: must be in [0, 65535]")
    if a.context_length is not None and a.context_length < 2:
        raise LaunchFlagError(f"--context-length {a.context_length}: must be >= 2")
    if a.sampling_mask_max_tokens < 1:
        raise LaunchFlagError(f"--sampling-mask-max-tokens {a.sampling_mask_max_tokens}: must be >= 1")
    if a.speculative_algorithm is not None:
        if a.speculative_algorithm not in ("NGRAM", "STANDALONE", "NEXTN"):
            raise LaunchFlagError(
                f"--speculative-algorithm: speculative decoding with {a.speculative_algorithm} is not served by the "
                "embedded engine (it has no EAGLE draft models); it serves NGRAM (prompt lookup), STANDALONE (a "
                "separate draft model) and NEXTN (the model's own MTP heads, model.mtp_num_layers)"
            )
        if a.speculative_algorithm == "STANDALONE" and not a.speculative_draft_model_path:
            raise LaunchFlagError("--speculative-algorithm STANDALONE: needs --speculative-draft-model-path")
        if a.speculative_num_steps < 1:
            raise LaunchFlagError(f"--speculative-num-steps {a.speculative_num_steps}: must be >= 1")
        if a.speculative_schedule not in ("fixed", "dspark"):
            raise LaunchFlagError(f"--speculative-schedule {a.speculative_schedule}: choose fixed or dspark")
        if a.speculative_confidence_head and a.speculative_schedule != "dspark":
            raise LaunchFlagError("--speculative-confidence-head: needs --speculative-schedule dspark")
        low, high = a.speculative_ngram_min_match_window_size, a.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise LaunchFlagError(
                f"--speculative-ngram-min-match-window-size {low} / --speculative-ngram-max-match-window-size "
                f"{high}: need 1 <= min <= max"
            )
    elif a.speculative_draft_model_path is not None:
        raise LaunchFlagError("--speculative-draft-model-path: needs --speculative-algorithm STANDALONE")
    if a.tool_call_parser is not None:
        try:
            tool_call_format(a.tool_call_parser)
        except ValueError as err:
            raise LaunchFlagError(f"--tool-call-parser {a.tool_call_parser}: {err}") from None
    if a.max_running_requests is not None and a.max_running_requests < 1:
        raise LaunchFlagError(f"--max-running-requests {a.max_running_requests}: must be >= 1")
    for flag, key in (("--api-key", a.api_key), ("--admin-api-key", a.admin_api_key)):
        if key is not None and (not key or not key.isascii() or not key.isprintable()):
            raise LaunchFlagError(f"{flag}: must be a non-empty printable ASCII string")
    for d in a.weight_dirs or []:
        if not os.path.isabs(d):
            raise LaunchFlagError(f"--weight-dirs {d}: must be an absolute path")
