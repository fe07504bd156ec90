"""A HF sequence classifier's forward on token rows: the one padding and pooling that every place
scoring a reward model shares, so that the trainer's reward head (`rewards/reward_model.py`), the
process reward model (`rewards/process_reward.py`), the `/classify` server
(`rollout/classifier.py`) and RRM's base-model filter in `mcore-rl rm-train` give the same numbers.

Rows are right-padded with the model's `pad_token_id` under an attention mask. A row's score is the
`score` layer at its last token (HF's pooling at the last token that is not padding); per-token
scores apply `score` to the decoder's last hidden state at every position (a process reward model
read at its step delimiters). A causal decoder's value at a position depends on the tokens up to it
only, so a prefix scored at its last token equals the full row's per-token value there: a PRM can be
served on a last-token route (`/classify`) by sending each step's prefix as its own row.
"""

from __future__ import annotations

from typing import Any

import torch


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [rows, width], attention mask [rows, width]): the rows right-padded with `pad_id`."""
    if not rows or any(not r for r in rows):
        raise ValueError("every row needs at least one token")
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return tokens, mask


@torch.no_grad()
def last_token_scores(model: Any, rows: list[list[int]], pad_id: int, device: str = "cpu") -> torch.Tensor:
    """[rows, num_labels] float32 on the CPU: each row's scores at its last token."""
    tokens, mask = pad_rows(rows, pad_id)
    logits = model(tokens.to(device), attention_mask=mask.to(device)).logits
    return logits.float().cpu()


@torch.no_grad()
def token_scores(model: Any, rows: list[list[int]], pad_id: int, device: str = "cpu") -> list[torch.Tensor]:
    """One [len, num_labels] float32 CPU tensor per row: the `score` layer at every position."""
    tokens, mask = pad_rows(rows, pad_id)
    decoder = getattr(model, model.base_model_prefix)
    hidden = decoder(tokens.to(device), attention_mask=mask.to(device)).last_hidden_state
    values = model.score(hidden).float().cpu()
    return [values[i, : len(r)] for i, r in enumerate(rows)]


def load_classifier(model_dir: str, device: str = "cpu") -> Any:
    """A local HF `*ForSequenceClassification` directory, in eval mode on `device`; `ValueError`
    naming the directory if it does not load or has no `pad_token_id` to pool at."""
    from transformers import AutoModelForSequenceClassification  # lazy: transformers is slow to import

    try:
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"reward model {model_dir!r} does not load: {err}"[:500]) from None
    if model.config.pad_token_id is None:
        raise ValueError(f"{model_dir}/config.json: pad_token_id is not set; the classifier pools at it")
    return model.to(device).eval()
