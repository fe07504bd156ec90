"""Label responses with a generative teacher's score distribution (Z-Reward), for the student.

Each row of `--data` (jsonl) is a response `{"prompt", "response"}`, or a preference pair
`{"prompt", "chosen", "rejected"}` (`tools/make_preference_pairs.py`), whose two sides become two
rows. The teacher — a causal LM served by SGLang or `mcore-rl serve` at `--url`, or an `mcore-rl
serve` this tool starts on `--model-path` — is asked with the judging template of
`rewards/generative_rm.py` (the same prompt, cue, score tokens and wire format as the
`generative_rm` reward head), and each row is written as `rm-train`'s `score_distribution`
objective reads it:

    {"prompt": "12+30=", "response": "42", "label": [q_0, ..., q_{S-1}], "expected_score": mu}

    python tools/label_score_distributions.py --model-path runs/judge_hf --data pairs.jsonl --out teacher.jsonl
    mcore-rl rm-train configs/rm_demo.yaml data.path=teacher.jsonl reward_model.objective=score_distribution \\
        reward_model.num_heads=10

A line that is not a JSON object, lacks a field or has an empty response is refused as
`file:line: problem` before the teacher is asked (`--on-bad-line skip` skips it, counted); a score
token of several tokens of the teacher's tokenizer is refused naming `--score-tokens`; a batch the
teacher cannot answer stops the tool naming its lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from typing import Any

import torch

from mcore_rl.algos.z_reward import expected_score
from mcore_rl.data.files import BadLines, DataError, json_objects, read_lines
from mcore_rl.rewards.generative_rm import (
    RUBRIC,
    CUE,
    SCORE_TOKENS,
    TEMPLATE,
    GenerativeJudge,
    GenerativeRMError,
    JudgeSpec,
)
from mcore_rl.rewards.judge import CHAT_FORMATS, JudgeServer


def read_rows(path: str, on_bad_line: str, prompt_key: str = "prompt") -> list[tuple[str, str, str]]:
    """(source "file:line", prompt, response) of every response of the file (a pair gives two)."""
    bad = BadLines(path, on_bad_line)
    rows: list[tuple[str, str, str]] = []
    for lineno, obj in json_objects(read_lines(path, bad, key="--data"), bad):
        sides = ["response"] if "response" in obj else ["chosen", "rejected"]
        need = [prompt_key, *sides]
        missing = [k for k in need if k not in obj]
        if missing:
            bad.report(
                lineno, f"missing key(s) {missing} (a row needs prompt and response, or prompt, chosen and rejected)"
            )
            continue
        wrong = [k for k in need if not isinstance(obj[k], str)]
        if wrong:
            bad.report(lineno, f"expected strings: {', '.join(f'{k!r} is {type(obj[k]).__name__}' for k in wrong)}")
            continue
        empty = [k for k in sides if not obj[k].strip()]
        if empty:
            bad.report(lineno, f"empty response(s) {empty}")
            continue
        rows += [(f"{path}:{lineno}", obj[prompt_key], obj[k]) for k in sides]
    if not rows:
        raise DataError(f"{path}: no rows to label")
    return rows


async def label(judge: GenerativeJudge, rows: list[tuple[str, str, str]], batch: int) -> list[torch.Tensor]:
    """q [S] of every row, `batch` rows per request."""
    out: list[torch.Tensor] = []
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        try:
            q = await judge.distributions([judge.spec.render(p, r) for _, p, r in part])
        except Exception as err:
            raise SystemExit(f"{part[0][0]} .. {part[-1][0]}: the teacher did not score these rows: {err}") from None
        out += list(q)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", action="append", help="a server speaking SGLang's /generate (repeat for several)")
    where.add_argument("--model-path", help="an HF causal LM: this tool serves it with `mcore-rl serve` meanwhile")
    ap.add_argument("--data", required=True, help="jsonl of {prompt, response} or {prompt, chosen, rejected}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--template-file", help="the judging template (fields {prompt} {response} {rubric} {reference})")
    ap.add_argument("--rubric", default=RUBRIC)
    ap.add_argument("--cue", default=CUE, help="what precedes the score token")
    ap.add_argument("--score-tokens", default=",".join(SCORE_TOKENS), help="comma-separated, each one token")
    ap.add_argument("--score-values", help="comma-separated numbers, one per score token (default 0, 1, ...)")
    ap.add_argument("--chat-format", default="none", choices=sorted(CHAT_FORMATS))
    ap.add_argument("--reasoning-tokens", type=int, default=0, help="> 0: the teacher reasons first, up to this many")
    ap.add_argument("--reasoning-temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=16, help="rows per request")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--api-key")
    ap.add_argument("--on-bad-line", default="error", choices=("error", "skip"))
    ap.add_argument("--engine-threads", type=int, default=1, help="--model-path: the served engine's torch threads")
    args = ap.parse_args(argv)
    try:
        spec = JudgeSpec(
            template=open(args.template_file).read() if args.template_file else TEMPLATE,
            rubric=args.rubric,
            cue=args.cue,
            score_tokens=tuple(args.score_tokens.split(",")),
            score_values=tuple(float(v) for v in args.score_values.split(",")) if args.score_values else None,
            chat_format=args.chat_format,
            reasoning_tokens=args.reasoning_tokens,
            reasoning_temperature=args.reasoning_temperature,
        )
        spec.check()
    except (GenerativeRMError, ValueError) as err:
        option, _, why = str(err).partition(": ")
        sys.exit(f"--{option.replace('_', '-')}: {why}" if why else f"error: {err}")
    try:
        rows = read_rows(args.data, args.on_bad_line)
    except DataError as err:
        sys.exit(str(err).replace("data.on_bad_line=skip", "--on-bad-line skip"))
    judges = None
    try:
        if args.model_path:
            from mcore_rl.config.rl_schema import JudgeConfig
            from mcore_rl.rollout.judges import JudgeEngines

            group = JudgeConfig(name="teacher", model_path=args.model_path, engine_threads=args.engine_threads)
            workdir = tempfile.mkdtemp(prefix="label_teacher_")
            judges = JudgeEngines([group], workdir=workdir, context_length=2048, startup_timeout_s=300)
            urls = judges.urls["teacher"]
        else:
            urls = args.url
        server = JudgeServer(urls if len(urls) > 1 else urls[0], timeout=args.timeout, api_key=args.api_key)
        judge = GenerativeJudge(server, spec, args.batch)
        try:
            asyncio.run(judge.resolve_score_ids())
        except GenerativeRMError as err:
            option, _, why = str(err).partition(": ")
            sys.exit(f"--{option.replace('_', '-')}: {why}" if option == "score_tokens" else f"error: {err}")
        qs = asyncio.run(label(judge, rows, args.batch))
    finally:
        if judges is not None:
            judges.close()
    values = torch.tensor(spec.values, dtype=torch.float64)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for (_, prompt, response), q in zip(rows, qs):
            probs = [float(p) for p in q]
            row: dict[str, Any] = {
                "prompt": prompt,
                "response": response,
                "label": probs,
                "expected_score": float(expected_score(q, values)),
            }
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {args.out} (score tokens {list(spec.score_tokens)}, ids {judge.score_ids})")


if __name__ == "__main__":
    main()
