"""DSpark's confidence head: the predicted acceptance c_{r,i} of draft i given drafts < i were accepted.

"DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation" (PKU &
DeepSeek, 2026) trains a head beside its drafter that predicts per-position conditional
acceptance, calibrates it with sequential temperature scaling (STS) on a validation set, and lets
the scheduler (`spec_schedule.py`) read a_{r,j} = prod_{i <= j} c_{r,i} from it. Here the head is a
logistic model over features of a request's drafts that the engine has before verification:

* the position i (1-based; log i), and the request's acceptance so far (its accepted / reached
  drafts shrunk towards the engine's rate, `AcceptanceRate`; as a logit);
* a model draft's q_i — the distribution draft i was drawn from: its largest probability and its
  entropy over log V (zero for point-mass drafts);
* prompt lookup's match length (the n of the n-gram that matched; zero for model drafts).

None of them reads the drafted token x_i itself (q_i is fixed before x_i is drawn), so a cut chosen
from them keeps the speculative sampling exact (see `spec_schedule.py`). The target's hidden state,
which DSpark's head reads through its drafter, is not a feature: no drafter here but NEXTN keeps it.

Training (`tools/train_confidence_head.py`): the engine logs, for every reached draft (verified with
every earlier draft of its pass accepted), its features, whether it was accepted, and its
acceptance probability sum_v min(p(v), q(v)) (p(x) for a point mass: DSpark's soft label). `fit`
minimises the binary cross-entropy to the soft labels (lower variance than the 0/1 outcomes, same
expectation), then STS fits one temperature per position on held-out rows, also to the soft labels. As
each row is a *conditional* acceptance (reached rows only), calibrating each position on its own
rows calibrates the products a_{r,j} too (the chain rule); that is the "sequential" part.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mcore_rl.config.confidence_head import FEATURES, read_confidence_head


def draft_features(probs: torch.Tensor | None, n_tokens: int, acceptance: float, match: int) -> torch.Tensor:
    """[n_tokens, len(FEATURES)] float32 features of one request's drafts: `probs` [n, V] the draft's q
    per position (None: point masses), `acceptance` the request's shrunk acceptance so far, `match`
    prompt lookup's n-gram length. Reads q, never the drafted tokens."""
    f = torch.zeros(n_tokens, len(FEATURES), dtype=torch.float32)
    if n_tokens == 0:
        return f
    a = min(max(acceptance, 1e-3), 1 - 1e-3)
    f[:, 0] = 1.0
    f[:, 1] = torch.log(torch.arange(1, n_tokens + 1, dtype=torch.float32))
    f[:, 2] = math.log(a / (1 - a))
    if probs is not None:
        q = probs[:n_tokens].double()
        q = q / q.sum(-1, keepdim=True)
        f[:, 3] = q.max(-1).values.float()
        ent = -(q * q.clamp_min(1e-30).log()).sum(-1) / math.log(q.shape[-1])
        f[:, 4] = ent.float()
    f[:, 5] = float(match)
    return f


@dataclass
class ConfidenceHead:
    """c = sigmoid((w . f + b) / T_i) with T_i the STS temperature of position i (the last one for
    positions past the fitted ones)."""

    weights: list[float]
    temperatures: list[float] = field(default_factory=lambda: [1.0])
    features: tuple[str, ...] = FEATURES

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Uncalibrated logits of [n, F] feature rows."""
        return feats.double() @ torch.tensor(self.weights, dtype=torch.float64)

    def predict(self, feats: torch.Tensor) -> list[float]:
        """Calibrated conditional acceptance of one request's drafts, position i = row i (1-based i + 1)."""
        if feats.shape[0] == 0:
            return []
        z = self.logits(feats)
        last = len(self.temperatures) - 1
        t = torch.tensor([self.temperatures[min(i, last)] for i in range(feats.shape[0])], dtype=torch.float64)
        return torch.sigmoid(z / t).tolist()

    def predict_rows(self, feats: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance of logged rows (any position mix), reading each row's position."""
        z = self.logits(feats)
        pos = feats[:, 1].exp().round().long() - 1
        t = torch.tensor(self.temperatures, dtype=torch.float64)[pos.clamp(0, len(self.temperatures) - 1)]
        return torch.sigmoid(z / t)

    def to_json(self) -> str:
        return json.dumps({"features": list(self.features), "weights": self.weights, "temperatures": self.temperatures})

    @classmethod
    def load(cls, path: str) -> ConfidenceHead:
        """The head a `save` wrote; ValueError naming the key it cannot serve."""
        weights, temps = read_confidence_head(path)
        return cls(weights, temps)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")


def fit(feats: torch.Tensor, soft: torch.Tensor, l2: float = 1e-3, iters: int = 200) -> ConfidenceHead:
    """Logistic regression of the soft labels `soft` [N] in [0, 1] on `feats` [N, F] (BCE, L2 on all
    weights but the bias), by L-BFGS. Temperatures 1."""
    x, y = feats.double(), soft.double().clamp(0, 1)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=iters, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y) + l2 * (w[1:] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return ConfidenceHead([float(v) for v in w.detach()])


def fit_temperatures(head: ConfidenceHead, feats: torch.Tensor, soft: torch.Tensor, positions: int) -> ConfidenceHead:
    """STS: per position 1..`positions`, the temperature (grid over [0.25, 4], log-spaced) that minimises
    the cross-entropy of the head's calibrated prediction against the soft labels `soft` on those rows
    (the outcomes' expectation: a position whose validation drafts were all accepted does not drive its
    temperature to the grid's end); a position without rows keeps the previous one's."""
    z = head.logits(feats)
    pos = feats[:, 1].exp().round().long()
    y = soft.double().clamp(0, 1)
    grid = torch.exp(torch.linspace(math.log(0.25), math.log(4.0), 61, dtype=torch.float64))
    temps: list[float] = []
    for i in range(1, positions + 1):
        rows = pos == i
        if not bool(rows.any()):
            temps.append(temps[-1] if temps else 1.0)
            continue
        zi, yi = z[rows], y[rows]
        losses = [float(torch.nn.functional.binary_cross_entropy_with_logits(zi / t, yi)) for t in grid]
        temps.append(float(grid[min(range(len(losses)), key=losses.__getitem__)]))
    return ConfidenceHead(list(head.weights), temps)


@dataclass
class Calibration:
    """Predicted against observed acceptance on held-out rows."""

    bins: list[tuple[float, float, float, int]]  # (mean predicted, observed rate, mean soft label, rows) per bin
    ece: float  # expected calibration error: sum over bins of rows/N x |predicted - observed|
    brier: float  # mean (predicted - outcome)^2
    log_loss: float


def calibration(predicted: torch.Tensor, outcome: torch.Tensor, soft: torch.Tensor, bins: int = 10) -> Calibration:
    """Reliability table of `predicted` [N] against the 0/1 `outcome` [N] in equal-width bins."""
    p, y, s = predicted.double(), outcome.double(), soft.double()
    n = len(p)
    idx = (p * bins).long().clamp(0, bins - 1)
    table: list[tuple[float, float, float, int]] = []
    ece = 0.0
    for b in range(bins):
        rows = idx == b
        k = int(rows.sum())
        if k == 0:
            continue
        mp, my, ms = float(p[rows].mean()), float(y[rows].mean()), float(s[rows].mean())
        table.append((mp, my, ms, k))
        ece += k / n * abs(mp - my)
    pc = p.clamp(1e-6, 1 - 1e-6)
    log_loss = float(-(y * pc.log() + (1 - y) * (1 - pc).log()).mean())
    return Calibration(table, ece, float(((p - y) ** 2).mean()), log_loss)


def stack_log(log: Sequence[tuple[torch.Tensor, bool, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [N, F], outcomes [N], soft labels [N]) of an engine's `spec_log` rows."""
    if not log:
        return torch.zeros(0, len(FEATURES)), torch.zeros(0), torch.zeros(0)
    return (
        torch.stack([row[0] for row in log]),
        torch.tensor([float(row[1]) for row in log]),
        torch.tensor([float(row[2]) for row in log]),
    )
