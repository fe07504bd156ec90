"""SGLang's launch flags that `mcore-rl serve` does not honour itself, each classified.

A launch line written for `python -m sglang.launch_server` should start the embedded engine unless
one of its flags would change what the server generates or returns. `launch_flags.py` honours the
flags that matter to the embedded engine; every other flag of SGLang's `ServerArgs` (its server
arguments documentation and `server_args.py`, 2025-2026 main) is listed here as one of:

- `IGNORED`: it tunes a GPU server (kernels, CUDA graphs, memory pools and caches, overlap,
  parallel transports, tokenizer workers), its deployment (logging, metrics, tracing, warmup), or a
  feature that stays off unless another flag or a request field turns it on (and those are refused
  where they would change something). No generated token and no reply changes: accepted, logged
  once at start and listed in `/get_server_info` under `ignored_flags`. (`--skip-tokenizer-init`:
  the engine keeps its tokenizer, so replies to token-id requests carry `text` as well.)
- `REFUSED`: it changes what is generated or returned (speculative decoding, LoRA adapters, chat
  templates and output parsers, truncation, model overrides, TLS, a gRPC server, ...): an error
  naming the flag and why, before the model loads.
- `ONLY`: accepted at the values listed (SGLang's default, or what the embedded engine does
  anyway), refused at any other, naming the flag and the value.

A flag in none of them is not an SGLang flag this list knows (a newer one, or a typo): refused, so
that a flag that would change results is never dropped silently.
"""

from __future__ import annotations

# ---- accepted and ignored: no token and no reply changes ------------------------------------------
IGNORED: frozenset[str] = frozenset(
    # model loading and the tokenizer's processes
    "--tokenizer-worker-num --detokenizer-worker-num --tokenizer-backend --model-loader-extra-config "
    "--skip-tokenizer-init "
    "--enable-multimodal --model-impl --model-config-parser --download-dir --model-checksum "
    "--checkpoint-engine-wait-weights-before-ready --quantization-param-path --enable-quant-communications "
    "--modelopt-checkpoint-save-path --modelopt-export-path --rl-quant-profile --delete-ckpt-after-loading "
    "--weight-loader-disable-mmap --weight-loader-prefetch-checkpoints --weight-loader-prefetch-num-threads "
    "--remote-instance-weight-loader-seed-instance-ip --remote-instance-weight-loader-seed-instance-service-port "
    "--remote-instance-weight-loader-send-weights-group-ports --remote-instance-weight-loader-backend "
    "--remote-instance-weight-loader-start-seed-via-transfer-engine --decrypted-draft-config-file "
    # memory pools, caches and scheduling
    "--max-queued-requests --prefill-decode-interval --enable-dynamic-chunking --prefill-max-requests "
    "--enable-priority-scheduling --disable-priority-preemption --default-priority-value "
    "--abort-on-priority-when-disabled --schedule-low-priority-values-first "
    "--priority-scheduling-preemption-threshold --retraction-policy --schedule-conservativeness --page-size "
    "--c128-page-size --swa-full-tokens-ratio --disable-hybrid-swa-memory --hybrid-kvcache-ratio "
    "--radix-eviction-policy --radix-cache-backend --prefill-only-disable-kv-cache "
    "--enable-page-major-kv-layout --enable-unified-memory --disable-chunked-prefix-cache "
    "--disable-overlap-schedule --num-continuous-decode-steps --scheduler-recv-interval --enable-mixed-chunk "
    "--enable-prefill-delayer --prefill-delayer-max-delay-passes --prefill-delayer-token-usage-low-watermark "
    "--prefill-delayer-queue-min-ratio --prefill-delayer-max-delay-ms --prefill-delayer-forward-passes-buckets "
    "--prefill-delayer-wait-seconds-buckets --strip-thinking-cache --enable-session-radix-cache "
    "--enable-streaming-session --max-mamba-cache-size --mamba-ssm-dtype --mamba-full-memory-ratio "
    "--mamba-scheduler-strategy --mamba-track-interval --enable-hierarchical-cache --hicache-ratio "
    "--hicache-size --hicache-write-policy --hicache-io-backend --hicache-mem-layout --hicache-storage-backend "
    "--hicache-storage-prefetch-policy --hicache-storage-backend-extra-config --enable-lmcache "
    "--cpu-offload-gb --offload-group-size --offload-num-in-group --offload-prefetch-step --offload-mode "
    "--enable-draft-weights-cpu-backup --num-reserved-decode-tokens "
    # distributed setup and transports (one process on one device here)
    "--nccl-port --dist-timeout --dist-init-addr --nccl-init-addr --gated-launch-port --pp-max-micro-batch-size "
    "--pp-async-batch-depth --load-balance-method --dcp-comm-backend --dcp-replicate-q-proj "
    "--no-dcp-replicate-q-proj --enable-prefill-cp --cp-strategy --enable-dsa-cache-layer-split "
    "--enable-cp-decode-attn-tp --enable-dp-attention --enable-dp-attention-local-control-broadcast "
    "--enable-dp-lm-head --enable-tp-lm-head-all-to-all --no-enable-tp-lm-head-all-to-all "
    "--enable-attn-tp-input-scattered --enable-shared-experts-attn-tp --enable-dense-mlp-attn-tp "
    "--disable-attn-tp-gather --enable-p2p-check --enable-dsa-prefill-context-parallel "
    "--enable-nsa-prefill-context-parallel --dsa-prefill-cp-mode --nsa-prefill-cp-mode --moe-dense-tp-size "
    "--disaggregation-transfer-backend --disaggregation-bootstrap-port --disaggregation-ib-device "
    "--disaggregation-decode-enable-offload-kvcache --disaggregation-decode-polling-interval "
    "--encoder-transfer-backend --encoder-urls --language-only --enable-pdmux --pdmux-config-path "
    "--sm-group-num --use-ray --numa-node --base-gpu-id --gpu-id-step "
    # MoE kernels and expert placement (the routing itself is the model's)
    "--moe-a2a-backend --moe-runner-backend --flashinfer-mxfp4-moe-precision "
    "--enable-flashinfer-allreduce-fusion --enable-aiter-allreduce-fusion --deepep-mode "
    "--deepep-dispatcher-output-dtype --enable-fused-grouped-gemm-combine --ep-num-redundant-experts "
    "--ep-dispatch-algorithm --init-expert-location --enable-eplb --eplb-algorithm "
    "--eplb-rebalance-num-iterations --eplb-rebalance-layers-per-chunk "
    "--eplb-min-rebalancing-utilization-threshold --expert-distribution-recorder-mode "
    "--expert-distribution-recorder-buffer-size --enable-expert-distribution-metrics --deepep-config "
    "--elastic-ep-backend --enable-elastic-expert-backup --mooncake-ib-device --enable-deepep-waterfill "
    "--elastic-ep-rejoin --disable-shared-experts-fusion --disable-flashinfer-cutlass-moe-fp4-allgather "
    "--enable-ep-moe --enable-deepep-moe --enable-flashinfer-cutlass-moe --enable-flashinfer-cutedsl-moe "
    "--enable-flashinfer-trtllm-moe --enable-triton-kernel-moe --enable-flashinfer-mxfp4-moe "
    "--prefill-round-robin-balance "
    # kernels, CUDA graphs, compilation
    "--decode-attention-backend --prefill-attention-backend --mm-attention-backend --grammar-backend "
    "--fp8-gemm-backend --fp4-gemm-backend --bf16-gemm-backend --dsa-prefill-backend --dsv4-prefill-backend "
    "--dsa-decode-backend --dsa-paged-mqa-logits-backend --dsa-topk-backend --nsa-prefill-backend "
    "--nsa-decode-backend --nsa-prefill --nsa-decode --disable-flashinfer-autotune "
    "--flashinfer-autotune-skip-ops --mamba-backend --flashinfer-mla-disable-ragged "
    "--cuda-graph-config --cuda-graph-backend-decode --cuda-graph-backend-prefill --cuda-graph-max-bs-decode "
    "--cuda-graph-max-bs-prefill --cuda-graph-bs --cuda-graph-bs-decode --cuda-graph-bs-prefill "
    "--cuda-graph-tc-compiler --disable-prefill-cuda-graph --disable-decode-cuda-graph "
    "--disable-cuda-graph-padding --enable-profile-cuda-graph --enable-cudagraph-gc --debug-cuda-graph "
    "--disable-piecewise-cuda-graph --enforce-piecewise-cuda-graph --piecewise-cuda-graph-tokens "
    "--piecewise-cuda-graph-compiler --piecewise-cuda-graph-max-tokens --enable-torch-compile "
    "--enable-torch-compile-debug-mode --torch-compile-max-bs --enable-layerwise-nvtx-marker "
    "--enable-nccl-nvls --enable-symm-mem --enable-torch-symm-mem --enable-mscclpp "
    "--disable-custom-all-reduce --triton-attention-reduce-in-fp32 --triton-attention-num-kv-splits "
    "--triton-attention-split-tile-size --enable-two-batch-overlap --enable-single-batch-overlap "
    "--tbo-token-distribution-threshold --enable-fused-qk-norm-rope --enable-precise-embedding-interpolation "
    "--enable-tokenizer-batch-encode --disable-tokenizer-batch-decode --disable-outlines-disk-cache "
    "--enable-dynamic-batch-tokenizer --dynamic-batch-tokenizer-batch-size "
    "--dynamic-batch-tokenizer-batch-timeout "
    # what the embedded engine does anyway: requests never depend on their batch mates; the model
    # is the trainer's reference model; logits of a NaN are not special-cased
    "--enable-deterministic-inference --rl-on-policy-target --enable-nan-detection --crash-on-nan "
    # features that stay off here unless a request asks (and such requests are refused by field)
    "--enable-custom-logit-processor --enable-return-hidden-states --multi-item-scoring-delimiter "
    "--constrained-json-whitespace-pattern --constrained-json-disable-any-whitespace "
    "--enable-lora-overlap-loading --max-lora-rank --lora-target-modules --max-loras-per-batch "
    "--max-loaded-loras --lora-eviction-policy --lora-backend --max-lora-chunk-size "
    "--lora-drain-wait-threshold --speculative-draft-model-revision --speculative-draft-load-format "
    "--speculative-eagle-topk --speculative-num-draft-tokens "
    "--speculative-accept-threshold-single --speculative-accept-threshold-acc --speculative-token-map "
    "--speculative-attention-mode --speculative-draft-attention-backend --speculative-moe-runner-backend "
    "--speculative-moe-a2a-backend --speculative-draft-model-quantization "
    "--speculative-ngram-min-bfs-breadth --speculative-ngram-max-bfs-breadth --speculative-ngram-match-type "
    "--speculative-ngram-max-trie-depth --speculative-ngram-capacity --enable-multi-layer-eagle "
    "--dllm-algorithm-config --kt-method --kt-cpuinfer --kt-threadpool-count --kt-num-gpu-experts "
    "--kt-max-deferred-experts-per-token --mm-max-concurrent-calls --mm-per-request-timeout "
    "--enable-broadcast-mm-inputs-process --mm-process-config --mm-enable-dp-encoder "
    "--limit-mm-data-per-request --enable-mm-global-cache --enable-prefix-mm-cache "
    "--disable-fast-image-processor --keep-mm-feature-on-device --asr-max-buffer-seconds "
    "--asr-max-concurrent-sessions --file-storage-path "
    # HTTP serving details, streaming granularity, warmup
    "--fastapi-root-path --enable-http2 --http2-max-concurrent-streams --warmups --stream-interval "
    "--batch-notify-size --enable-cache-report "
    # logging, metrics, tracing, debugging dumps
    "--log-requests --log-requests-level --log-requests-format --log-requests-target "
    "--uvicorn-access-log-exclude-prefixes --crash-dump-folder --show-time-cost --enable-metrics "
    "--smg-http-sidecar-port --grpc-http-sidecar-port --enable-mfu-metrics --enable-metrics-for-all-schedulers "
    "--load-snapshot-publish-interval --tokenizer-metrics-custom-labels-header "
    "--tokenizer-metrics-allowed-custom-labels --extra-metric-labels --bucket-time-to-first-token "
    "--bucket-inter-token-latency --bucket-e2e-request-latency --collect-tokens-histogram "
    "--prompt-tokens-buckets --generation-tokens-buckets --gc-warning-threshold-secs --decode-log-interval "
    "--enable-request-time-stats-logging --kv-events-config --enable-forward-pass-metrics --enable-trace "
    "--trace-modules --otlp-traces-endpoint --export-metrics-to-file --export-metrics-to-file-dir "
    "--watchdog-timeout --soft-watchdog-timeout --sleep-on-idle --gc-threshold --load-watch-interval "
    "--debug-tensor-dump-output-folder --debug-tensor-dump-layers --debug-tensor-dump-input-file "
    "--debug-tensor-dump-inject --msprobe-dump-config".split()
)

# ---- refused: they change what is generated or returned ----------------------------------------
REFUSED: dict[str, str] = {
    "--enable-lora": "LoRA adapters are not supported by the embedded engine",
    "--lora-paths": "LoRA adapters are not supported by the embedded engine",
    "--chat-template": "chat prompts use the tokenizer's own template (or ChatML) here; a custom template would change them",
    "--hf-chat-template-name": "chat prompts use the tokenizer's default template here",
    "--completion-template": "completion templates are not supported by the embedded engine",
    "--default-chat-template-kwargs": "would change every chat prompt; pass chat_template_kwargs per request",
    "--reasoning-parser": "no reasoning parser: the reply would not split reasoning from content",
    "--tool-server": "built-in tool servers are not supported by the embedded engine",
    "--enable-strict-thinking": "would filter tokens during thinking; not supported by the embedded engine",
    "--preferred-sampling-params": "would change every request's default sampling parameters",
    "--allow-auto-truncate": "the embedded engine refuses (400) a request that does not fit, as SGLang does by default",
    "--json-model-override-args": "would change the model's config; edit config.json instead",
    "--revision": "the embedded engine reads a local directory (--model-path) only",
    "--enable-weights-cpu-backup": "released weights come back as zeros until a weight update here",
    "--enable-fp32-lm-head": "the LM head runs in --dtype here (use --dtype float32 for fp32 logits)",
    "--enable-tf32-matmul": "TF32 matmuls would change the engine's numerics",
    "--modelopt-quant": "the embedded engine supports --quantization fp8 only",
    "--modelopt-checkpoint-restore-path": "the embedded engine supports --quantization fp8 only",
    "--quantize-and-serve": "the embedded engine supports --quantization fp8 only",
    "--kt-weight-path": "CPU experts with quantized weights would change the engine's numerics",
    "--hierarchical-sparse-attention-extra-config": "sparse attention would change what is generated",
    "--dllm-algorithm": "diffusion LLMs are not supported by the embedded engine",
    "--encoder-only": "the embedded engine serves the language model",
    "--custom-weight-loader": "weight updates go through the embedded engine's own loaders",
    "--forward-hooks": "forward hooks could change what is generated",
    "--decrypted-config-file": "the model's config.json is read as it is",
    "--smg-grpc-mode": "the embedded engine serves HTTP only",
    "--grpc-mode": "the embedded engine serves HTTP only",
    "--grpc-port": "the embedded engine serves HTTP only (no gRPC server would listen there)",
    "--sidecar": "the embedded engine serves HTTP only (no gRPC server for a sidecar)",
    "--sidecar-args": "the embedded engine serves HTTP only (no gRPC server for a sidecar)",
    "--ssl-keyfile": "the embedded engine serves plain HTTP; put a TLS proxy in front",
    "--ssl-certfile": "the embedded engine serves plain HTTP; put a TLS proxy in front",
    "--ssl-ca-certs": "the embedded engine serves plain HTTP; put a TLS proxy in front",
    "--ssl-keyfile-password": "the embedded engine serves plain HTTP; put a TLS proxy in front",
    "--enable-ssl-refresh": "the embedded engine serves plain HTTP; put a TLS proxy in front",
    "--stream-response-default-include-usage": "streams include usage only with stream_options.include_usage here",
    "--config": "give the flags on the command line (config files are not read)",
}

# ---- accepted at these values only ----------------------------------------------------------------
ONLY: dict[str, tuple[tuple[str, ...], str]] = {
    "--pp-size": (("1",), "the embedded engine runs in one process on one device"),
    "--pipeline-parallel-size": (("1",), "the embedded engine runs in one process on one device"),
    "--ep-size": (("1",), "the embedded engine runs in one process on one device"),
    "--expert-parallel-size": (("1",), "the embedded engine runs in one process on one device"),
    "--ep": (("1",), "the embedded engine runs in one process on one device"),
    "--attn-cp-size": (("1",), "the embedded engine runs in one process on one device"),
    "--attention-context-parallel-size": (("1",), "the embedded engine runs in one process on one device"),
    "--moe-dp-size": (("1",), "the embedded engine runs in one process on one device"),
    "--moe-data-parallel-size": (("1",), "the embedded engine runs in one process on one device"),
    "--dcp-size": (("1",), "the embedded engine runs in one process on one device"),
    "--decode-context-parallel-size": (("1",), "the embedded engine runs in one process on one device"),
    "--dwdp-size": (("1",), "the embedded engine runs in one process on one device"),
    "--nnodes": (("1",), "the embedded engine runs on one node"),
    "--node-rank": (("0",), "the embedded engine runs on one node"),
    "--disaggregation-mode": (("null",), "prefill/decode disaggregation is not supported by the embedded engine"),
    "--tokenizer-mode": (("auto",), "the tokenizer is loaded as it is (fast when available)"),
    "--sampling-defaults": (
        ("openai",),
        "unset sampling parameters take SGLang's/OpenAI's defaults here, not generation_config.json's; pass 'openai'",
    ),
    "--torchao-config": (("",), "torchao quantization would change the engine's numerics"),
}


def classify(flag: str, values: list[str]) -> str | None:
    """None if `flag` with `values` (empty for a switch) is accepted and ignored; else the one-line
    reason it is refused. `flag` is spelled with its dashes, without `=value`."""
    if flag in IGNORED:
        return None
    if flag in REFUSED:
        return f"{flag}: {REFUSED[flag]}"
    if flag in ONLY:
        allowed, why = ONLY[flag]
        value = " ".join(values)
        if value in allowed:
            return None
        return f"{flag} {value}: {why} (only {' or '.join(repr(a) for a in allowed)})"
    return (
        f"{flag}: not a flag of SGLang's server that mcore-rl serve knows (see `mcore-rl serve --help`, and "
        "mcore_rl/rollout/sglang_flags.py for the SGLang flags it accepts and ignores or refuses)"
    )
