"""RL algorithms as pure functions on tensors, registered by name (docs/design.md#pure-algorithms).

Nothing here knows about Megatron, process groups or HTTP: inputs are log-probs, masks, rewards and
group ids; outputs are tensors. Importing the package registers every algorithm, so
`registry.get("advantage", "grpo")` works after `import mcore_rl.algos`.

Shape conventions: per-token tensors are [N, T] (N sequences, T response positions, right-padded;
`mask` is 1 on response tokens that count), per-sequence tensors are [N], group ids are [N] ints.
"""

from mcore_rl.algos import (  # noqa: F401  (imported for their registrations)
    advantages,
    alp,
    appo,
    cgpo,
    delta,
    distill,
    dvao,
    dynamic_sampling,
    edge_gec,
    edge_grpo,
    entropy,
    entropy_adv,
    exprl,
    gae,
    gagpo,
    gigpo,
    golongrl,
    hgpo,
    kl,
    mipu,
    mismatch,
    papo,
    polaris,
    policy_loss,
    prof_grpo,
    rlcer,
    s2l_po,
    steppo,
    unlikeliness,
    vimpo,
    w_reinforce,
)
from mcore_rl.algos import dpo  # noqa: F401  (AutoIF's preference loss)
from mcore_rl.algos import craft, encore, rluf  # noqa: F401  (compositions of reward-model heads; RLUF's CRAFT)
from mcore_rl.algos.registry import get, names, register

__all__ = ["get", "names", "register"]
