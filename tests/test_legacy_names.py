"""Checkpoints exported before the reference classes got neutral names still load.

`fixtures/legacy_mcore_rl_qwen3.tar.gz` is a tiny AttnRes model exported by the exporter of that
time (`write_hf_checkpoint`, bf16): `model_type: mcore_rl_qwen3`, an `auto_map` naming
`McoreRLQwen3Config` / `Qwen3ReferenceForCausalLM`, and that time's remote-code files. Its own code,
today's classes (through the Auto classes, no remote code), the embedded engine and the converter
must all read it, and agree on its logits.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tarfile
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

import mcore_rl.hf as hf
from mcore_rl.config.model_keys.attn_res import AttnResKeys

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "legacy_mcore_rl_qwen3.tar.gz"
TOKENS = torch.tensor([[1, 5, 9, 2, 330, 17, 4, 260]])


@pytest.fixture(scope="module")
def legacy_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("legacy")
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(root, filter="data")
    path = root / "legacy_mcore_rl_qwen3"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "mcore_rl_qwen3"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.Qwen3ReferenceForCausalLM"
    return path


# A fresh interpreter without mcore_rl (whose registered classes transformers would prefer) loads the
# export through its own remote code and saves its logits.
_LOAD_REMOTE = textwrap.dedent(
    """
    import sys
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ReferenceForCausalLM", type(model)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert "mcore_rl" not in sys.modules
    with torch.no_grad():
        torch.save(model(torch.tensor(eval(sys.argv[2]))).logits, sys.argv[3])
    """
)


@pytest.fixture(scope="module")
def legacy_logits(legacy_dir: pathlib.Path) -> torch.Tensor:
    """The logits of the export's own remote code (the classes of that time)."""
    out = legacy_dir.parent / "logits.pt"
    args = [sys.executable, "-c", _LOAD_REMOTE, str(legacy_dir), repr(TOKENS.tolist()), str(out)]
    subprocess.run(args, check=True, cwd=legacy_dir.parent, env={**os.environ, "PYTHONPATH": ""}, timeout=300)
    return torch.load(out)


def test_auto_classes_read_a_legacy_export_without_remote_code(legacy_dir, legacy_logits) -> None:
    model = AutoModelForCausalLM.from_pretrained(legacy_dir, dtype=torch.float32).eval()
    assert isinstance(model, hf.McoreRLForCausalLM) and model.config.model_type == "mcore_rl_qwen3"
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, legacy_logits, rtol=0, atol=0)


def test_engine_serves_a_legacy_export(legacy_dir, legacy_logits) -> None:
    from mcore_rl.rollout.engine.core import EngineCore

    engine = EngineCore.from_model_path(str(legacy_dir))  # float32, every weight read (strict)
    assert isinstance(engine.model, hf.McoreRLForCausalLM)
    assert engine.hf_model_type == "mcore_rl_qwen3" and engine.model.config.attn_res == "block"
    with torch.no_grad():
        torch.testing.assert_close(engine.model(TOKENS).logits, legacy_logits, rtol=0, atol=0)


def test_converter_reads_a_legacy_export_and_writes_todays_names(legacy_dir, tmp_path) -> None:
    from mcore_rl.convert.hf_checkpoint import model_config_from_hf, read_hf_config
    from mcore_rl.convert.to_hf import export_config

    mc = model_config_from_hf(read_hf_config(str(legacy_dir)))
    assert (
        mc.section(AttnResKeys).attn_res,
        mc.section(AttnResKeys).attn_res_num_blocks,
        mc.num_layers,
        mc.vocab_size,
    ) == ("block", 2, 2, 384)
    cfg, kind = export_config(mc, torch.bfloat16, json.loads((legacy_dir / "config.json").read_text()))
    assert kind == "remote" and cfg.model_type == "mcore_rl"
    assert cfg.architectures == ["McoreRLForCausalLM"]
    assert cfg.auto_map["AutoConfig"] == "configuration.McoreRLConfig"
