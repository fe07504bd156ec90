"""tools/encore_entropies.py: each head's score entropy over a real RM's training set, written as the
options the `encore` reward shaping reads."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import sys

import pytest
import torch
import yaml

from mcore_rl.algos.encore import encore, score_entropy
from mcore_rl.algos.multi_reward import option_problems
from mcore_rl.data.tokenizer import BUNDLED_DIR, TOKENIZER_FILE, load_tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
from encore_entropies import main

PAIRS = [("12+30=", "24", "25"), ("07+35=", "24", "34"), ("11+11=", "22", "2"), ("40+05=", "54", "45")]
PAIRS += [("33+21=", "45", "44"), ("19+19=", "83", "82")]


@pytest.fixture(scope="module")
def rm(tmp_path_factory) -> tuple[str, str]:
    """A three-head classifier on the bundled tokenizer (head 2 constant: its `score` row zeroed) and
    its training pairs."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = load_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tok.pad_id,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.bos_id,
    )
    config.num_labels = 3
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight[2].zero_()
    root = tmp_path_factory.mktemp("encore")
    model.save_pretrained(str(root / "hf"), safe_serialization=True)
    shutil.copy(f"{BUNDLED_DIR}/{TOKENIZER_FILE}", root / "hf" / TOKENIZER_FILE)  # as an export carries it
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    return str(root / "hf"), str(data)


def _hand_scores(model_dir: str) -> torch.Tensor:
    """Every response of PAIRS, one unpadded forward each, read at the last token: [12, 3]."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = load_tokenizer()
    rows = [[tok.bos_id, *tok.encode(p), *tok.encode(x), tok.eos_id] for p, c, r in PAIRS for x in (c, r)]
    with torch.no_grad():
        return torch.stack([model(torch.tensor([row])).logits[0] for row in rows])


def test_entropies_of_each_head_over_the_training_set(rm, tmp_path):
    model_dir, data = rm
    out = tmp_path / "encore.yaml"
    args = ["--model-dir", model_dir, "--data", data, "--heads", "safe,helpful,flat", "--tau", "0.5"]
    entry = main([*args, "--decimals", "1", "--out", str(out)])
    scores = _hand_scores(model_dir)
    assert entry["name"] == "encore"
    options = entry["options"]
    assert options["heads"] == ["safe", "helpful", "flat"] and options["tau"] == 0.5 and options["decimals"] == 1
    for k, head in enumerate(options["heads"]):
        assert options["entropies"][head] == pytest.approx(score_entropy(scores[:, k], 1), abs=1e-9)
    assert options["entropies"]["flat"] == 0.0  # one value everywhere
    assert 0 < options["entropies"]["safe"] < math.log(12)  # rounded: some scores coincide
    # unrounded, every one of the 12 distinct sequences has its own value: log 12 for a live head
    raw = main([*args, "--decimals", "-1"])["options"]
    assert raw["decimals"] is None and raw["entropies"]["safe"] == pytest.approx(math.log(12))

    # the file is the reward-shaping entry: valid options, and the shaping uses those entropies
    written = yaml.safe_load(out.read_text())
    assert written == [entry] and option_problems("reward_shaping", "encore", options) == []
    heads = torch.tensor([[0.3, 1.0, 0.0], [0.1, -2.0, 0.0], [0.9, 0.5, 0.0]], dtype=torch.float64)
    rewards = torch.zeros(3)
    got = encore(rewards, torch.zeros(3, dtype=torch.long), reward_heads=heads, head_names=options["heads"], **options)
    ent = torch.tensor([options["entropies"][h] for h in ("safe", "helpful")], dtype=torch.float64)
    w = torch.softmax(-ent / 0.5, 0)  # the constant head weighs 0
    assert torch.allclose(got.double(), (heads[:, :2] * w).sum(1).float().double(), atol=1e-6)


def test_heads_must_name_every_head(rm, capsys):
    model_dir, data = rm
    with pytest.raises(SystemExit):
        main(["--model-dir", model_dir, "--data", data, "--heads", "safe,helpful"])
    assert "--heads: 2 names for a model with 3 heads" in capsys.readouterr().err
