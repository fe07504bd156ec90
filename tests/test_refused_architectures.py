"""Architectures megatron-core 0.16.1 cannot build here (`hf/refused_architectures.py`): the converter,
the profiler and the embedded engine refuse each with one line naming what it is and what it would
need; docs/serving.md lists the same types."""

from __future__ import annotations

import json
import os

import pytest

from mcore_rl.convert import SUPPORTED_MODEL_TYPES, read_hf_config
from mcore_rl.hf.refused_architectures import REFUSED_ARCHITECTURES, refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkpoint(tmp_path, model_type: str) -> str:
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    return str(path)


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h", "deepseek_v32", "minimax"])
def test_the_loaders_refuse_in_one_line_naming_the_architecture_and_the_need(tmp_path, model_type) -> None:
    from mcore_rl.rollout.engine.core import _load_config

    path = _checkpoint(tmp_path, model_type)
    arch = REFUSED_ARCHITECTURES[model_type]
    for load in (read_hf_config, _load_config):
        with pytest.raises(ValueError) as err:
            load(path)
        message = str(err.value)
        assert "\n" not in message and arch.what in message and arch.needed in message, message
        assert "megatron-core 0.16.1" in message


def test_the_profiler_refuses_as_the_converter_does(tmp_path, capsys) -> None:
    from mcore_rl import cli

    code = cli.main(["profile", _checkpoint(tmp_path, "jamba"), "--cluster", "h100_sxm", "--nodes", "1"])
    err = capsys.readouterr().err
    assert code == 2 and REFUSED_ARCHITECTURES["jamba"].what in err, err


def test_the_table_and_the_docs_agree_and_nothing_refused_is_supported() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert not set(REFUSED_ARCHITECTURES) & set(SUPPORTED_MODEL_TYPES)
    # every refused type is one transformers knows (a typo would refuse nothing)
    assert set(REFUSED_ARCHITECTURES) <= set(CONFIG_MAPPING_NAMES), set(REFUSED_ARCHITECTURES) - set(
        CONFIG_MAPPING_NAMES
    )
    with open(os.path.join(ROOT, "docs", "serving.md"), encoding="utf-8") as f:
        rows = {line.split("|")[1].strip().strip("`") for line in f if line.lstrip().startswith("| `")}
    assert set(REFUSED_ARCHITECTURES) <= rows, set(REFUSED_ARCHITECTURES) - rows
    assert refusal("qwen3") is None and refusal(None) is None
