"""`mcore-rl convert gguf-to-hf` on tiny GGUF files written here with the `gguf` package.

The file is written the way llama.cpp's converter writes a Llama checkpoint (its tensor names, its
q/k row permutation, a GPT-2 byte-level BPE tokenizer with merges and a chat template), from a
tiny `LlamaForCausalLM`; converting it back must give the same logits and a tokenizer that
encodes like the one written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tests.helpers import _gguf_tokens as _tokens, tiny_llama, write_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mcore_rl.convert.gguf import gguf_to_hf

    root = tmp_path_factory.mktemp("gguf")
    model = tiny_llama()
    path = str(root / "tiny.gguf")
    write_gguf(model, path, quantize_ffn=True)
    out = str(root / "hf")
    summary = gguf_to_hf(path, out)
    return model, path, out, summary


def test_logits_match_the_model_written(converted):
    from transformers import AutoModelForCausalLM

    model, _, out, summary = converted
    assert summary["model_type"] == "llama" and summary["chat_template"]
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 77, 90, 3, 200, 12, 260]])
    with torch.no_grad():
        want, got = model(ids).logits, back(ids).logits
    # the FFN went through Q8_0 (8-bit blocks): close, not equal; attention and norms are exact f32
    assert torch.allclose(got, want, atol=5e-2), float((got - want).abs().max())
    assert float((got - want).abs().max()) > 0  # the quantised tensors really were dequantised
    with torch.no_grad():
        assert torch.equal(back.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
        assert torch.equal(back.model.layers[1].self_attn.k_proj.weight, model.model.layers[1].self_attn.k_proj.weight)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # tied, as written


def test_tokenizer_chat_template_and_generation_config(converted):
    from transformers import AutoTokenizer, GenerationConfig

    _, _, out, _ = converted
    tok = AutoTokenizer.from_pretrained(out)
    tokens = _tokens()
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["hell", "o", "Ġw", "o", "r", "l", "d"]
    assert tok.decode(ids) == "hello world"
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == 2 and gen.bos_token_id == 1
    with open(os.path.join(out, "gguf_source.json")) as f:
        assert json.load(f)["architecture"] == "llama"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "convert", "gguf-to-hf", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bad_files_are_refused_naming_the_file_and_field(tmp_path, converted):
    from mcore_rl.convert.gguf import GGUFError, inspect_gguf

    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    r = _cli("--input", str(not_gguf), "--output", str(tmp_path / "o1"))  # the command's exit path
    assert r.returncode == 2 and "model.gguf: not a GGUF file" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o1")

    other = tmp_path / "gpt2.gguf"
    write_gguf(tiny_llama(), str(other), arch="gpt2")
    with pytest.raises(GGUFError, match=r"gpt2.gguf: field 'general.architecture' is 'gpt2'; supported: .*llama"):
        inspect_gguf(str(other))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(open(converted[1], "rb").read()[:1000])
    with pytest.raises(GGUFError, match="cut.gguf: unreadable GGUF file"):
        inspect_gguf(str(truncated))
    with pytest.raises(FileNotFoundError, match="no such file"):
        inspect_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileExistsError, match="is not empty"):
        from mcore_rl.convert.gguf import gguf_to_hf

        gguf_to_hf(converted[1], converted[2])


def test_cli_converts_and_hf_to_mcore_accepts_the_result(tmp_path, converted):
    from mcore_rl.convert.hf_checkpoint import model_config_from_hf, read_hf_config

    out = tmp_path / "hf"
    r = _cli("--input", converted[1], "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert "llama with" in r.stdout and "chat template" in r.stdout
    mc = model_config_from_hf(read_hf_config(str(out)))  # what `convert hf-to-mcore` reads first
    assert mc.num_layers == 2 and mc.hidden_size == 64 and mc.num_query_groups == 2
