"""GRAPE: keep, for every instruction, the candidate response the target model finds most likely.

Reads a jsonl whose rows hold a prompt and a list of candidate responses (strings, or objects with
a response key and anything else, e.g. their source), scores every candidate by its
length-normalised log-likelihood under the model (`mcore_rl/algos/grape.py`: mean log-prob of the
response tokens given `[bos] prompt`, as SFT tokenises the pair) and writes one SFT row per prompt:
the kept candidate's fields, `prompt`, `response`, `grape_score`, `grape_perplexity` and
`grape_index` (its position among the row's candidates). Nothing is trained; the model's weights
are never written and no gradient is computed.

Scorers (`--scorer`):
  engine     the embedded engine's prompt scoring (SGLang's max_new_tokens=0 request with
             return_logprob from the last prompt token), in-process;
  reference  one forward of the engine's reference model (`mcore_rl/hf/modeling.py`) per candidate;
  url        the same prompt-scoring request to a running SGLang / `mcore-rl serve` server (--url).

    .venv/bin/python tools/grape_select.py candidates.jsonl kept.jsonl --model runs/demo/hf
    .venv/bin/python tools/grape_select.py candidates.jsonl kept.jsonl --scorer url --url http://127.0.0.1:30000

`--model` omitted: the built-in demo model with its seeded random weights (for tests and smoke
runs). `--reverse` keeps the lowest score (Reverse-GRAPE, the paper's baseline). A row whose
candidates cannot be scored (none longer than zero tokens, or over the context) keeps nothing and
is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from typing import Any
from collections.abc import Iterable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.algos.grape import grape_scores, perplexity, select

Pair = tuple[list[int], list[int]]  # (prompt ids, response ids)


def read_rows(path: str, prompt_key: str, candidates_key: str) -> list[dict[str, Any]]:
    """The jsonl's rows; ValueError naming `file:line` for a row without a prompt or candidates."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get(prompt_key), str):
                raise ValueError(f"{path}:{n}: no string {prompt_key!r}")
            if not isinstance(row.get(candidates_key), list) or not row[candidates_key]:
                raise ValueError(f"{path}:{n}: {candidates_key!r} must be a non-empty list of candidates")
            rows.append(row)
    return rows


def candidate_fields(candidate: Any, response_key: str) -> dict[str, Any]:
    """A candidate as a dict with `response_key` (a bare string is the response)."""
    if isinstance(candidate, str):
        return {response_key: candidate}
    if isinstance(candidate, dict) and isinstance(candidate.get(response_key), str):
        return dict(candidate)
    raise ValueError(f"a candidate must be a string or an object with a string {response_key!r}: {candidate!r}")


def tokenize_pair(tokenizer: Any, prompt: str, response: str, with_eos: bool = False) -> Pair:
    """`[bos] prompt` and `response [eos]` ids, as `data/sft.py: tokenize_example` builds the row."""
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    prompt_ids = bos + (tokenizer.encode(prompt) if prompt else [])
    response_ids = tokenizer.encode(response) + ([tokenizer.eos_id] if with_eos else [])
    return prompt_ids, response_ids


class EngineScorer:
    """The embedded engine's prompt scoring: log p(response_j | prompt, response_<j) per token."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def score(self, pairs: Sequence[Pair]) -> list[list[float] | None]:
        from mcore_rl.rollout.engine.core import Request
        from mcore_rl.rollout.engine.sampling import SamplingParams

        out: list[list[float] | None] = [None] * len(pairs)
        rid_of: dict[str, int] = {}
        for i, (p, r) in enumerate(pairs):
            if not r or not p or len(p) + len(r) > self.engine.context_length:
                continue
            rid = f"grape-{i}"
            rid_of[rid] = i
            self.engine.add_request(
                Request(rid, p + r, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=len(p) - 1)
            )
        while self.engine.has_work():
            for res in self.engine.step():
                if res.finished and res.rid in rid_of:
                    i = rid_of[res.rid]
                    entries = res.input_token_logprobs[1:]  # the first is the last prompt token's (None)
                    if [t for _, t in entries] != pairs[i][1]:
                        raise RuntimeError(f"the engine scored other tokens than candidate {i}'s")
                    out[i] = [float(lp) for lp, _ in entries]
        return out


class ReferenceScorer:
    """One no-grad forward of a causal LM (the engine's reference model) per candidate."""

    def __init__(self, model: torch.nn.Module, context_length: int) -> None:
        self.model, self.context_length = model.eval(), context_length

    def score(self, pairs: Sequence[Pair]) -> list[list[float] | None]:
        out: list[list[float] | None] = []
        param = next(self.model.parameters())
        with torch.inference_mode():
            for p, r in pairs:
                if not r or not p or len(p) + len(r) > self.context_length:
                    out.append(None)
                    continue
                ids = torch.tensor([p + r], device=param.device)
                logits = self.model(ids).logits[0, len(p) - 1 : len(p) + len(r) - 1].double()
                lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(p) :, None]).squeeze(1)
                out.append(lp.cpu().tolist())
        return out


class URLScorer:
    """SGLang's prompt-scoring `/generate` request (`rollout/teacher.py: scoring_body`) to a server."""

    def __init__(self, url: str, timeout: float = 60.0, api_key: str | None = None) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/generate") else base + "/generate"
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def score(self, pairs: Sequence[Pair]) -> list[list[float] | None]:
        from mcore_rl.rollout.teacher import parse_scores, scoring_body

        out: list[list[float] | None] = []
        for i, (p, r) in enumerate(pairs):
            if not r or not p:
                out.append(None)
                continue
            body = json.dumps(scoring_body(p, r, 0, f"grape-{i}")).encode()
            req = urllib.request.Request(self.url, body, self.headers)
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                reply = json.loads(resp.read())
            out.append(parse_scores(reply, r, 0, 1 << 62, self.url).logp)
        return out


def score_matrix(token_logps: Sequence[list[float] | None]) -> torch.Tensor:
    """GRAPE scores [C] from per-candidate token log-probs (None: not scored -> NaN)."""
    t = max((len(x) for x in token_logps if x), default=0)
    lp = torch.zeros(len(token_logps), t, dtype=torch.float64)
    mask = torch.zeros(len(token_logps), t)
    for i, x in enumerate(token_logps):
        if x:
            lp[i, : len(x)] = torch.tensor(x, dtype=torch.float64)
            mask[i, : len(x)] = 1
    return grape_scores(lp, mask)


def grape_select(
    rows: Sequence[dict[str, Any]],
    scorer: Any,
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    candidates_key: str = "candidates",
    response_key: str = "response",
    reverse: bool = False,
    with_eos: bool = False,
) -> tuple[list[dict[str, Any]], list[int]]:
    """(the kept rows, the input rows that kept nothing)."""
    cands, pairs, group = [], [], []
    for g, row in enumerate(rows):
        for c in row[candidates_key]:
            fields = candidate_fields(c, response_key)
            cands.append(fields)
            pairs.append(tokenize_pair(tokenizer, row[prompt_key], fields[response_key], with_eos))
            group.append(g)
    scores = score_matrix(scorer.score(pairs))
    gids = torch.tensor(group, dtype=torch.long)
    kept = select(scores, gids, reverse=reverse)
    first = {g: group.index(g) for g in set(group)}
    out, empty = [], []
    for g, j in enumerate(kept.tolist()):  # group ids are 0..len(rows)-1, so sorted order is row order
        if j < 0:
            empty.append(g)
            continue
        extra = {k: v for k, v in rows[g].items() if k not in (candidates_key,)}
        s = float(scores[j])
        out.append(
            {
                **extra,
                **cands[j],
                prompt_key: rows[g][prompt_key],
                "grape_score": s,
                "grape_perplexity": float(perplexity(torch.tensor(s))),
                "grape_index": j - first[g],
            }
        )
    return out, empty


def build_scorer(
    kind: str,
    model: str | None,
    tokenizer_path: str | None,
    url: str | None,
    context_length: int,
    api_key: str | None = None,
) -> tuple[Any, Any]:
    """(scorer, tokenizer) for `--scorer` (url: the tokenizer of --tokenizer, else --model's, else the
    bundled one; it must be the server's)."""
    from mcore_rl.data.tokenizer import load_tokenizer

    if kind == "url":
        if not url:
            raise SystemExit("--scorer url needs --url")
        return URLScorer(url, api_key=api_key), load_tokenizer(tokenizer_path or model)
    from mcore_rl.rollout.engine.core import EngineCore

    engine = EngineCore.from_model_path(model, tokenizer_path=tokenizer_path, context_length=context_length)
    if kind == "engine":
        return EngineScorer(engine), engine.tokenizer
    return ReferenceScorer(engine.model, context_length), engine.tokenizer


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", help="jsonl: a prompt and a list of candidates per row")
    ap.add_argument("output", help="jsonl of the kept (prompt, response) rows")
    ap.add_argument("--scorer", choices=("engine", "reference", "url"), default="engine")
    ap.add_argument("--model", default=None, help="HF directory of the target model (default: the demo model)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    ap.add_argument("--url", default=None, help="with --scorer url: the server")
    ap.add_argument("--api-key", default=None, help="with --scorer url: the server's --api-key")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--prompt-key", default="prompt")
    ap.add_argument("--candidates-key", default="candidates")
    ap.add_argument("--response-key", default="response")
    ap.add_argument("--reverse", action="store_true", help="keep the lowest score (Reverse-GRAPE)")
    ap.add_argument("--with-eos", action="store_true", help="score the eos token too (SFT trains on it)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    rows = read_rows(args.input, args.prompt_key, args.candidates_key)
    scorer, tokenizer = build_scorer(
        args.scorer, args.model, args.tokenizer, args.url, args.context_length, args.api_key
    )
    kept, empty = grape_select(
        rows,
        scorer,
        tokenizer,
        prompt_key=args.prompt_key,
        candidates_key=args.candidates_key,
        response_key=args.response_key,
        reverse=args.reverse,
        with_eos=args.with_eos,
    )
    with open(args.output, "w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(
        f"kept {len(kept)} of {len(rows)} prompts ({sum(len(r[args.candidates_key]) for r in rows)} candidates)"
        + (f"; nothing scorable in rows {empty}" if empty else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
