"""How fast a tiny model learns a task from scratch: SFT a plain-torch stand-in, then greedy accuracy.

The stand-in has the shape of the demo `ModelConfig` (2 layers, 64 wide, 4 heads, byte-level: 256
bytes + end-of-text), learned positions instead of RoPE; 32 examples per step, AdamW lr 3e-3 with
cosine decay, loss on the answer only. It then answers 100 newly drawn prompts greedily and the
task's own reward scores them (for code tasks, in the sandbox).

    .venv/bin/python benchmarks/task_learnability.py tiny_code --steps 50 100 300
    .venv/bin/python benchmarks/task_learnability.py word_format --steps 300
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn

from mcore_rl.data.tasks import get_task
from mcore_rl.rewards import RewardInput, get_reward_fn

EOT, T, BATCH = 256, 40, 32


class StandIn(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(EOT + 1, d), nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, EOT + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)
        return self.out(self.blocks(self.emb(x) + self.pos(torch.arange(n)), mask=mask, is_causal=True))


def _batch(examples: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ms = [], []
    for p, a in examples:
        pb, ab = list(p.encode()), list(a.encode())
        xs.append((pb + ab + [EOT] * T)[:T])
        ms.append(([0] * len(pb) + [1] * (len(ab) + 1) + [0] * T)[:T])
    return torch.tensor(xs), torch.tensor(ms, dtype=torch.float)


def learn(task_name: str, steps: int, seed: int = 0) -> dict[str, float]:
    torch.manual_seed(seed)
    task = get_task(task_name)
    model = StandIn()
    opt = torch.optim.AdamW(model.parameters(), 3e-3, weight_decay=0.01)
    data = task.examples(steps * BATCH, seed=1)
    loss = torch.tensor(0.0)
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * i / steps))
        x, mask = _batch(data[i * BATCH : (i + 1) * BATCH])
        logits = model(x[:, :-1])
        per_token = nn.functional.cross_entropy(logits.reshape(-1, EOT + 1), x[:, 1:].reshape(-1), reduction="none")
        loss = (per_token * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    @torch.no_grad()
    def greedy(prompt: str) -> str:
        seq = list(prompt.encode())
        for _ in range(task.max_answer_tokens()):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            if nxt == EOT or len(seq) >= T - 1:
                break
            seq.append(nxt)
        return bytes(b for b in seq[len(prompt.encode()) :] if b < EOT).decode(errors="replace")

    held_out = task.examples(100, seed=99)
    answers = [greedy(p) for p, _ in held_out]
    fn = get_reward_fn(task.reward)
    rewards = [fn(RewardInput(p, a))["reward"] for a, (p, _) in zip(answers, held_out)]
    return {
        "loss": loss.item(),
        "exact": sum(a == r for a, (_, r) in zip(answers, held_out)) / len(held_out),
        "mean_reward": sum(rewards) / len(rewards),
        "all_pass": sum(r == 1.0 for r in rewards) / len(rewards),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("--steps", type=int, nargs="+", default=[300])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{args.task}: {'steps':>6}{'loss':>8}{'exact':>8}{'reward':>8}{'all pass':>10}   seconds")
    for steps in args.steps:
        start = time.time()
        r = learn(args.task, steps)
        print(
            f"{'':<{len(args.task) + 2}}{steps:>6}{r['loss']:>8.3f}{r['exact']:>8.2f}{r['mean_reward']:>8.2f}"
            f"{r['all_pass']:>10.2f}   {time.time() - start:.0f}"
        )


if __name__ == "__main__":
    main()
