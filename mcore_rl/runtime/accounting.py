"""Where every drawn prompt went: the proof that the asynchronous runtime loses nothing.

Each prompt drawn from the data stream (one group of G samples) ends in exactly one of: trained,
filtered (with the reason, e.g. dynamic sampling's constant rewards), dropped as too stale, failed
(engine or other error, with the reason), or is still pending (in flight, waiting to be resent,
or in the buffer). The ledger counts them; `check()` verifies

    drawn = trained + filtered + dropped + failed + pending

and `report()` is what `accounting.json` in the run directory holds. The counts are checkpointed,
so the identity holds across a kill and resume (the pending groups are checkpointed with them).
Groups regenerated after being found too stale count once, as the prompt they are.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


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

    def finished(self) -> int:
        return self.trained + sum(self.filtered.values()) + self.dropped_stale + sum(self.failed.values())

    def check(self, pending: int) -> None:
        """Raise if a drawn prompt is unaccounted for (or counted twice)."""
        if self.drawn != self.finished() + pending:
            raise AssertionError(f"sample accounting broken: drawn {self.drawn} != trained {self.trained} + filtered "
                                 f"{sum(self.filtered.values())} + dropped {self.dropped_stale} + failed "
                                 f"{sum(self.failed.values())} + pending {pending}")

    def report(self, pending: int, group_size: int) -> dict[str, Any]:
        return {
            "unit": f"prompts (groups of {group_size} samples)",
            "drawn": self.drawn, "trained": self.trained,
            "filtered": sum(self.filtered.values()), "filtered_reasons": dict(self.filtered),
            "dropped_stale": self.dropped_stale,
            "failed": sum(self.failed.values()), "failed_reasons": dict(self.failed),
            "pending": pending,
            "balanced": self.drawn == self.finished() + pending,
            "regenerated_stale": self.regenerated_stale, "continued_requests": self.continued,
            "restarted_requests": self.restarted, "resent_after_resume": self.resent_after_resume,
            "restored_buffered": self.restored_buffered,
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
        return {"drawn": self.drawn, "trained": self.trained, "dropped_stale": self.dropped_stale,
                "regenerated_stale": self.regenerated_stale, "filtered": dict(self.filtered),
                "failed": dict(self.failed), "continued": self.continued, "restarted": self.restarted,
                "resent_after_resume": self.resent_after_resume, "restored_buffered": self.restored_buffered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, Counter(v) if k in ("filtered", "failed") else int(v))
