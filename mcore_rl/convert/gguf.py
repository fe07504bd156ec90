"""GGUF -> Hugging Face checkpoint (`mcore-rl convert gguf-to-hf`), the first half of GGUF -> megatron.

Pretrained models also ship as GGUF files (llama.cpp's format, often quantised: Q4_1, Q8_0, ...).
`transformers` reads them (with the `gguf` package) and dequantises every tensor to float32, but
its `save_pretrained` refuses a model loaded that way, so the weights are copied into a plain model
built from the same config and saved from there, with the tokenizer (and its chat template) and a
generation config whose end-of-turn token comes from the file. The output is an ordinary HF
directory that `mcore-rl convert hf-to-mcore`, `mcore-rl serve --model-path` and
`transformers.AutoModelForCausalLM` read.

Everything that can be checked without dequantising is checked first — the magic bytes, the
`general.architecture` field, that both `transformers` and this project's converter support that
architecture — so a wrong file fails in a second with a message naming the file and the field.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mcore_rl.convert.hf_checkpoint import SUPPORTED_MODEL_TYPES

GGUF_MAGIC = b"GGUF"
# GGUF architecture name -> HF model_type, for the architectures the project converts.
GGUF_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen3_moe": "qwen3_moe"}


class GGUFError(ValueError):
    """A GGUF file this converter cannot read; the message names the file and the field."""


def _field(reader: Any, name: str) -> Any:
    f = reader.fields.get(name)
    if f is None:
        return None
    return f.contents()


def inspect_gguf(path: str) -> dict[str, Any]:
    """The file's architecture, tensor count and tokenizer model, after the checks that need no
    dequantisation. Raises `GGUFError` (or FileNotFoundError) naming the file and the field."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path}: no such file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r})")
    import gguf  # lazy: gguf, an optional dependency

    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # truncated or corrupt: the reader raises whatever numpy raises
        raise GGUFError(f"{path}: unreadable GGUF file ({type(err).__name__}: {err})") from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: field 'general.architecture' is missing; cannot tell which model this is")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # lazy: needs gguf

    model_type = GGUF_ARCH_TO_MODEL_TYPE.get(arch)
    readable = arch in GGUF_SUPPORTED_ARCHITECTURES or arch.replace("moe", "_moe") in GGUF_SUPPORTED_ARCHITECTURES
    if model_type is None or model_type not in SUPPORTED_MODEL_TYPES or not readable:
        ours = sorted(a for a, t in GGUF_ARCH_TO_MODEL_TYPE.items() if t in SUPPORTED_MODEL_TYPES)
        raise GGUFError(f"{path}: field 'general.architecture' is {arch!r}; supported: {', '.join(ours)}")
    tokenizer_model = _field(reader, "tokenizer.ggml.model")
    if tokenizer_model is None:
        raise GGUFError(f"{path}: field 'tokenizer.ggml.model' is missing; the file carries no tokenizer")
    return {
        "architecture": arch,
        "model_type": model_type,
        "tensors": len(reader.tensors),
        "tokenizer_model": tokenizer_model,
        "name": _field(reader, "general.name"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def gguf_to_hf(path: str, output: str) -> dict[str, Any]:
    """Write `path` (a GGUF file) as a float32 HF checkpoint in `output`; returns what was written."""
    import torch  # lazy: torch, only for this command
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # lazy: transformers

    info = inspect_gguf(path)
    if os.path.exists(output) and os.listdir(output):
        raise FileExistsError(f"--output {output} is not empty")
    folder, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise GGUFError(
            f"{path}: tensors do not match the {info['model_type']} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if tied:
        plain.tie_weights()
    del loaded, state
    os.makedirs(output, exist_ok=True)
    plain.config.architectures = [type(plain).__name__]
    plain.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    gen = {k: info[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if isinstance(info[k], int)}
    GenerationConfig(**gen).save_pretrained(output)
    summary = {
        "source": os.path.basename(path),
        "architecture": info["architecture"],
        "model_type": info["model_type"],
        "parameters": sum(p.numel() for p in plain.parameters()),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        **gen,
    }
    with open(os.path.join(output, "gguf_source.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
