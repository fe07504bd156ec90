"""Preference pairs from a shipped verifiable task, as a jsonl for `mcore-rl rm-train data.path=...`.

Each pair is a task prompt, its verified answer (chosen) and a wrong answer the task's verifier
scores 0 (rejected); `--artifact length|format` plants a spurious feature on the correct answers
(`data/preferences.py: with_artifact`), `--reverse-artifact` on the wrong ones instead (a held-out
set that tells whether a reward model learned the artefact rather than correctness).

    python tools/make_preference_pairs.py --task addition --max-digits 2 --num 2000 --artifact length --out runs/pairs.jsonl
"""

from __future__ import annotations

import argparse
import json

from mcore_rl.data.preferences import ARTIFACTS, pair_to_json, task_pairs
from mcore_rl.data.tasks import task_names


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="addition", choices=task_names())
    ap.add_argument("--max-digits", type=int, default=2, help="the task's difficulty (addition: operand digits)")
    ap.add_argument("--num", type=int, default=1000, help="pairs to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--artifact", default="none", choices=ARTIFACTS)
    ap.add_argument("--reverse-artifact", action="store_true", help="plant the artefact on the wrong answers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    pairs = task_pairs(args.task, args.num, args.seed, args.max_digits, args.artifact, args.reverse_artifact)
    with open(args.out, "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair_to_json(pair)) + "\n")
    print(f"wrote {len(pairs)} pairs to {args.out}")


if __name__ == "__main__":
    main()
