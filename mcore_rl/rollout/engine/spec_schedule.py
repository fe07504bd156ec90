"""DSpark's confidence-scheduled verification: how many of each request's drafts one pass verifies.

"DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation" (PKU &
DeepSeek, 2026). A fixed draft length k verifies k drafts per request whatever the batch: at batch 1
(memory-bound) another position in the pass is almost free, at batch 64 (compute-bound) it costs
about as much as another request, and a draft that will be rejected wastes it. DSpark chooses the
verify length l_r of every request to maximise the expected system throughput

    tau = sum_r (1 + sum_{j <= l_r} a_{r,j}),   B = sum_r (1 + l_r),   Theta = tau x SPS(B),

where a_{r,j} = prod_{i <= j} c_{r,i} is the chance that draft j of request r survives (c_{r,i}: the
predicted acceptance of draft i given the earlier ones were accepted), and SPS(B) the target's
verification passes per second at B positions. Its greedy (Algorithm 1): pool every (r, j), sort by
a_{r,j} descending (ties: smaller j first), admit one at a time and stop at the first admission
that does not raise Theta. As a_{r,j} is non-increasing in j, the admitted set is a prefix of every
request's drafts.

Exactness: cutting a draft to its first l_r tokens keeps the speculative sampling exact as long as
the cut does not look at the tokens it keeps or drops: a confidence c_{r,i} may read the context
and the drafts before i, never draft i itself (choosing to verify x_i because q(x_i) is large would
bias which x_i get verified; tests/test_spec_schedule.py catches such a cut). There is no trained
confidence head here: c_{r,i} is the request's own acceptance so far, shrunk towards the engine's
(`AcceptanceRate`) — the same for every i, calibrated by construction, reading the past only. (The
draft distribution's largest probability, read before x_i is drawn, would also be exact, but it
measures the acceptance Σ min(p, q) poorly: a layer-skip draft of a flat model, accepted 93% of the
time, had largest probabilities near 0.05.) SPS(B) is a
least-squares line t(B) = t0 + t1 B through the target's measured pass times (the paper profiles a
table per deployment); until two batch sizes were seen the schedule is the fixed k.

Not here: DSpark's drafter (DFlash's parallel block with the Markov bias head) and its trained
confidence head, and the asynchronous variant that fixes the budget two steps ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

SPECULATIVE_SCHEDULES = ("fixed", "dspark")
EXPLORE_AFTER = 8  # steps a request's drafts may go unverified before its first one is verified anyway


def prefix_survival(confidences: Sequence[float]) -> list[float]:
    """a_j = prod_{i <= j} c_i for one request, each c clipped to [0, 1] (so a is non-increasing)."""
    out: list[float] = []
    a = 1.0
    for c in confidences:
        a *= min(1.0, max(0.0, float(c)))
        out.append(a)
    return out


def schedule_lengths(survival: Sequence[Sequence[float]], sps: Callable[[int], float]) -> list[int]:
    """DSpark's greedy: the verify length of every request (at most len(survival[r])) that maximises
    tau x SPS(B), given each request's prefix-survival probabilities `survival[r]` (non-increasing)
    and the passes per second `sps(B)` at B positions. A request with no drafts still counts one
    position and one token."""
    items = sorted(
        ((a, j, r) for r, row in enumerate(survival) for j, a in enumerate(row)),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    lengths = [0] * len(survival)
    tau = float(len(survival))
    positions = len(survival)
    best = tau * sps(positions)
    for a, j, r in items:
        if j != lengths[r]:  # never past a gap (only reachable with ties broken otherwise)
            continue
        theta = (tau + a) * sps(positions + 1)
        if theta <= best:
            break
        tau, positions, best = tau + a, positions + 1, theta
        lengths[r] += 1
    return lengths


class StepCost:
    """SPS(B) from measured passes: a least-squares line t(B) = t0 + t1 B through the last `window`
    (B, seconds) pairs of the target's verification and decode passes. None until two distinct B were
    seen; a line that does not rise with B (noise) means extra positions look free: constant SPS."""

    def __init__(self, window: int = 64) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, positions: int, seconds: float) -> None:
        if positions > 0 and seconds > 0:
            self.samples.append((positions, seconds))

    def line(self) -> tuple[float, float] | None:
        """(t0, t1) of the fit, or None without two distinct batch sizes."""
        n = len(self.samples)
        if n < 2:
            return None
        mean_b = sum(b for b, _ in self.samples) / n
        mean_t = sum(t for _, t in self.samples) / n
        var = sum((b - mean_b) ** 2 for b, _ in self.samples)
        if var == 0:
            return None
        t1 = sum((b - mean_b) * (t - mean_t) for b, t in self.samples) / var
        t1 = max(t1, 0.0)
        t0 = max(mean_t - t1 * mean_b, 1e-9)
        return t0, t1

    def sps(self) -> Callable[[int], float] | None:
        fit = self.line()
        if fit is None:
            return None
        t0, t1 = fit
        return lambda positions: 1.0 / (t0 + t1 * positions)


class AcceptanceRate:
    """The predicted acceptance of a request's next draft: its own accepted / reached drafts, shrunk
    towards the engine's rate with `weight` pseudo-drafts (a fresh request starts at the engine's
    rate, which starts at 1/2). Reached: verified with every earlier draft of its pass accepted."""

    def __init__(self, weight: float = 4.0) -> None:
        self.accepted = 0
        self.reached = 0
        self.weight = weight

    def observe(self, accepted: bool) -> None:
        self.reached += 1
        self.accepted += int(accepted)

    def of(self, accepted: int, reached: int) -> float:
        engine = (self.accepted + 1) / (self.reached + 2)
        return (accepted + self.weight * engine) / (reached + self.weight)
