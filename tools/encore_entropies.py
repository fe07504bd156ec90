"""ENCORE's entropies: each head's score entropy over a reward model's training set, written as the
options of the `encore` reward shaping.

ENCORE ("ENCORE: Entropy-guided Reward Composition for Multi-head Safety Reward Models") weighs the
heads of a multi-head RM by softmax(−H/τ), with H each head's entropy over the RM's *training set*,
computed once after training (`algos/encore.py`). Without it the shaping falls back to each batch's
own scores, a per-batch estimate. This tool runs the exported RM (a `*ForSequenceClassification`
dir, e.g. `mcore-rl convert mcore-to-hf` of an `rm-train` checkpoint) over every response of its
training file — both sides of a pair, or each labelled response — as `rm-train` read them
(`[bos] prompt response [eos]`, `data/preferences.py: sequence_ids`), reads every head at the last
token, and takes `head_entropies` of each head's scores rounded to `--decimals` places (the same
rounding the shaping's `decimals` option uses; the RM's scores are real numbers, every value
distinct, so without rounding every head would have the entropy log N).

    python tools/encore_entropies.py --model-dir runs/rm/hf --data pairs.jsonl --heads safe,helpful \\
        --tau 1.0 --decimals 2 --out encore.yaml

writes the reward-shaping entry to paste under `algorithm.reward_shaping`:

    {name: encore, options: {heads: [safe, helpful], tau: 1.0, decimals: 2, entropies: {safe: 1.93, helpful: 3.1}}}

`--heads` names the model's `num_labels` heads in order: the `key`s of the domain's `reward_model`
heads (each with its `head` index), which the shaping reads by name.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch

from mcore_rl.algos.encore import head_entropies
from mcore_rl.config.rm_schema import PreferenceDataConfig
from mcore_rl.data.preferences import LabelledResponse, PreferencePair, read_preference_file, sequence_ids
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.hf.classifier import last_token_scores, load_classifier


def training_sequences(examples: Sequence[PreferencePair | LabelledResponse], tokenizer: Tokenizer) -> list[list[int]]:
    """Every response of the training set as the RM read it: both sides of each pair, or each
    labelled response."""
    rows = []
    for e in examples:
        if isinstance(e, PreferencePair):
            rows += [sequence_ids(e.prompt, e.chosen, tokenizer), sequence_ids(e.prompt, e.rejected, tokenizer)]
        else:
            rows.append(sequence_ids(e.prompt, e.response, tokenizer))
    return rows


def head_scores(model: Any, rows: list[list[int]], batch_size: int = 64, device: str = "cpu") -> torch.Tensor:
    """[rows, num_labels]: every head at each row's last token, in batches."""
    pad = model.config.pad_token_id
    out = [last_token_scores(model, rows[i : i + batch_size], pad, device) for i in range(0, len(rows), batch_size)]
    return torch.cat(out)


def encore_options(
    scores: torch.Tensor, heads: Sequence[str], tau: float = 1.0, decimals: int | None = 2
) -> dict[str, Any]:
    """The `encore` shaping's options from the heads' scores [rows, K] over the training set."""
    if scores.shape[1] != len(heads):
        raise ValueError(f"--heads: {len(heads)} names for a model with {scores.shape[1]} heads")
    if len(set(heads)) != len(heads) or not all(heads):
        raise ValueError(f"--heads: names must be distinct and non-empty, got {list(heads)}")
    entropies = head_entropies({h: scores[:, k] for k, h in enumerate(heads)}, decimals)
    return {"heads": list(heads), "tau": tau, "decimals": decimals, "entropies": entropies}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="the exported RM, a *ForSequenceClassification dir")
    ap.add_argument("--data", required=True, help="its training file (data.path of rm-train)")
    ap.add_argument("--objective", default="bradley_terry", choices=["bradley_terry", "binary"])
    ap.add_argument("--heads", required=True, help="comma-separated names of the model's heads, in order")
    ap.add_argument("--tau", type=float, default=1.0, help="the shaping's softmax temperature")
    ap.add_argument("--decimals", type=int, default=2, help="scores rounded to this many places (-1: not)")
    ap.add_argument("--tokenizer-path", default=None, help="default: the model dir's")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the reward-shaping entry here (YAML)")
    args = ap.parse_args(argv)
    if args.tau <= 0:
        ap.error(f"--tau: must be > 0, got {args.tau}")
    heads = [h.strip() for h in args.heads.split(",")]
    model = load_classifier(args.model_dir, args.device)
    tokenizer = load_tokenizer(args.tokenizer_path or args.model_dir)
    if len(heads) != model.config.num_labels:
        ap.error(f"--heads: {len(heads)} names for a model with {model.config.num_labels} heads")
    examples = read_preference_file(PreferenceDataConfig(path=args.data), args.objective, model.config.num_labels)
    rows = training_sequences(examples, tokenizer)
    scores = head_scores(model, rows, args.batch_size, args.device)
    decimals = None if args.decimals < 0 else args.decimals
    entry = {"name": "encore", "options": encore_options(scores, heads, args.tau, decimals)}
    text = json.dumps(entry)  # JSON is YAML: paste it under algorithm.reward_shaping
    print(f"{len(rows)} responses of {len(examples)} examples; {text}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"- {text}\n")
    return entry


if __name__ == "__main__":
    main()
