"""Where every drawn prompt went: the proof that the asynchronous runtime loses nothing.

Each prompt drawn from the data stream (one group of G samples) ends in exactly one of: trained,
filtered (with the reason, e.g. dynamic sampling's constant rewards), dropped as too stale, failed
(engine or other error, with the reason), or is still pending (in flight, waiting to be resent,
or in the buffer). The ledger counts them; `check()` verifies

    drawn = trained + filtered + dropped + failed + pending

and `report()` is what `accounting.json` in the run directory holds. The counts are checkpointed,
so the identity holds across a kill and resume (the pending groups are checkpointed with them).
Groups regenerated after being found too stale count once, as the prompt they are.

Counts alone cannot show that no prompt was lost or trained twice across a kill (one of each
balances). So every step also appends the stream positions of the prompts it trained to
`provenance.jsonl` (ranges, a line per step), and `check_provenance(run_dir)` checks the claim
from the run directory alone (`python -m mcore_rl.runtime.accounting RUN_DIR` prints it).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Sequence


@dataclass
class SampleLedger:
    drawn: int = 0
    trained: int = 0
    dropped_stale: int = 0
    regenerated_stale: int = 0  # attempts thrown away and resent (the prompt stays pending)
    filtered: Counter = field(default_factory=Counter)  # reason -> groups
    failed: Counter = field(default_factory=Counter)  # reason -> groups
    continued: int = 0  # requests continued across a weight sync (partial rollouts)
    restarted: int = 0  # requests aborted by a sync and started again from scratch
    resent_after_resume: int = 0  # in flight at the checkpoint, submitted again by the resumed run
    restored_buffered: int = 0  # finished groups in the checkpoint's buffer, trained by the resumed run
    # multi-turn domains: the episodes of the trained groups, and the samples they became (one per
    # episode, one per step, or one per segment of a split conversation)
    episodes_trained: int = 0
    episode_samples_trained: int = 0

    def count_trained(self, groups: Sequence[Sequence[Any]]) -> None:
        """`groups` (of `Sample`s) were handed to the learner."""
        self.trained += len(groups)
        episodic = [s for g in groups for s in g if s.episode is not None]
        self.episodes_trained += len({(s.group, s.episode) for s in episodic})
        self.episode_samples_trained += len(episodic)

    def finished(self) -> int:
        return self.trained + sum(self.filtered.values()) + self.dropped_stale + sum(self.failed.values())

    def check(self, pending: int) -> None:
        """Raise if a drawn prompt is unaccounted for (or counted twice)."""
        if self.drawn != self.finished() + pending:
            raise AssertionError(
                f"sample accounting broken: drawn {self.drawn} != trained {self.trained} + filtered "
                f"{sum(self.filtered.values())} + dropped {self.dropped_stale} + failed "
                f"{sum(self.failed.values())} + pending {pending}"
            )

    def report(self, pending: int, group_size: int) -> dict[str, Any]:
        return {
            "unit": f"prompts (groups of {group_size} samples)",
            "drawn": self.drawn,
            "trained": self.trained,
            "filtered": sum(self.filtered.values()),
            "filtered_reasons": dict(self.filtered),
            "dropped_stale": self.dropped_stale,
            "failed": sum(self.failed.values()),
            "failed_reasons": dict(self.failed),
            "pending": pending,
            "balanced": self.drawn == self.finished() + pending,
            "regenerated_stale": self.regenerated_stale,
            "continued_requests": self.continued,
            "restarted_requests": self.restarted,
            "resent_after_resume": self.resent_after_resume,
            "restored_buffered": self.restored_buffered,
            "episodes_trained": self.episodes_trained,
            "episode_samples_trained": self.episode_samples_trained,
        }

    def write(self, path: str, pending: int, group_size: int) -> dict[str, Any]:
        report = self.report(pending, group_size)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
        return report

    def state_dict(self) -> dict[str, Any]:
        return {
            "drawn": self.drawn,
            "trained": self.trained,
            "dropped_stale": self.dropped_stale,
            "regenerated_stale": self.regenerated_stale,
            "filtered": dict(self.filtered),
            "failed": dict(self.failed),
            "continued": self.continued,
            "restarted": self.restarted,
            "resent_after_resume": self.resent_after_resume,
            "restored_buffered": self.restored_buffered,
            "episodes_trained": self.episodes_trained,
            "episode_samples_trained": self.episode_samples_trained,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, Counter(v) if k in ("filtered", "failed") else int(v))


# --------------------------------------------------------------------------------------------
# per-prompt provenance: which prompts each step trained
# --------------------------------------------------------------------------------------------

PROVENANCE = "provenance.jsonl"


def compact_ids(ids: Iterable[int]) -> list[list[int]]:
    """Sorted, distinct `ids` as inclusive ranges: [3, 4, 5, 9] -> [[3, 5], [9, 9]]."""
    out: list[list[int]] = []
    for i in sorted(set(ids)):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def expand_ids(ranges: Iterable[Sequence[int]]) -> list[int]:
    return [i for lo, hi in ranges for i in range(int(lo), int(hi) + 1)]


def record_trained_prompts(run_dir: str, step: int, prompt_indices: Iterable[int]) -> None:
    """Append the stream positions (`Prompt.index`) of the prompts step `step` trained to
    `<run_dir>/provenance.jsonl`, as ranges; one line per step, written (and flushed to disk)
    before the step's checkpoint, so that a resumed run that does a step again appends a line for
    it that replaces the killed run's (see `check_provenance`)."""
    ids = list(prompt_indices)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, PROVENANCE), "a") as f:
        f.write(json.dumps({"step": int(step), "n": len(set(ids)), "prompts": compact_ids(ids)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def trained_by_step(run_dir: str) -> dict[int, list[int]]:
    """The prompts each step of the run trained, as the run stands: a line for a step at or before
    one already read means the run was resumed from a checkpoint of the step before it, so the
    killed run's lines from that step on are dropped (their training was lost with the process)."""
    steps: dict[int, list[int]] = {}
    with open(os.path.join(run_dir, PROVENANCE)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step, ids = int(rec["step"]), expand_ids(rec["prompts"])
            except (ValueError, KeyError, TypeError) as err:
                if not line.endswith("\n"):  # the last line of a killed run, cut off mid-write
                    continue
                raise ValueError(f"{os.path.join(run_dir, PROVENANCE)}:{n}: not a provenance record ({err})") from None
            for later in [s for s in steps if s >= step]:
                del steps[later]
            steps[step] = ids
    return steps


@dataclass
class ProvenanceCheck:
    trained: int  # distinct prompts trained
    duplicates: dict[int, list[int]]  # prompt index -> the steps that trained it (more than one)
    missing_steps: list[int]  # steps without a line
    problems: list[str]  # against accounting.json, when the run directory has one

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing_steps or self.problems)


def check_provenance(run_dir: str) -> ProvenanceCheck:
    """Check from the run directory alone that no prompt was trained twice (also across a kill and
    resume) and, with `accounting.json`, that none was lost: the prompts trained are as many as
    the ledger's `trained`, all among the `drawn` first of the stream, and the others are exactly
    as many as the ledger's filtered + dropped + failed + pending."""
    steps = trained_by_step(run_dir)
    seen: dict[int, list[int]] = {}
    for step in sorted(steps):
        for i in steps[step]:
            seen.setdefault(i, []).append(step)
    duplicates = {i: s for i, s in seen.items() if len(s) > 1}
    missing = [s for s in range(1, max(steps, default=0) + 1) if s not in steps]
    problems: list[str] = []
    acc_path = os.path.join(run_dir, "accounting.json")
    if os.path.exists(acc_path):
        with open(acc_path) as f:
            acc = json.load(f)
        if len(seen) != acc["trained"]:
            problems.append(f"{len(seen)} prompts trained by the steps' records, accounting.json says {acc['trained']}")
        beyond = sorted(i for i in seen if i >= acc["drawn"])
        if beyond:
            problems.append(f"prompts {compact_ids(beyond)} trained but beyond the {acc['drawn']} drawn")
        others = acc["filtered"] + acc["dropped_stale"] + acc["failed"] + acc["pending"]
        if acc["drawn"] - len(seen) != others:
            problems.append(
                f"{acc['drawn'] - len(seen)} drawn prompts were not trained, but accounting.json accounts "
                f"for {others} (filtered + dropped + failed + pending): "
                f"{acc['drawn'] - len(seen) - others} lost"
            )
    return ProvenanceCheck(len(seen), duplicates, missing, problems)


if __name__ == "__main__":
    import sys

    result = check_provenance(sys.argv[1])
    print(
        json.dumps(
            {
                "ok": result.ok,
                "trained": result.trained,
                "duplicates": result.duplicates,
                "missing_steps": result.missing_steps,
                "problems": result.problems,
            },
            indent=2,
        )
    )
    sys.exit(0 if result.ok else 1)
