"""Rules of `data.domains[i].agent` (a domain whose episodes are runs of an unmodified agent program),
checked with the rest of the RL config before any worker starts; every message names the dotted key.

The program must be runnable from where the run starts (its first word an executable, a `.py`
argument an existing file), its limits positive, its tool-call format the model family's (as an
environment's). The domain is an ordinary prompt domain otherwise (its source, its rewards: the
answer is scored by them), but renders no prompt template: the agent writes its own messages.
Both engine pools serve agents (the proxy's completions go through the rollout scheduler's loop),
so no pool or schedule is refused.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import TYPE_CHECKING

from mcore_rl.config.rl_environment import check_tool_format
from mcore_rl.config.rules import Errors

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import DomainConfig, RLConfig


def check_agent(cfg: RLConfig, i: int, dom: DomainConfig, errors: Errors) -> None:
    """The agent's command, limits and tool-call format, and what the domain may not set with it."""
    agent = dom.agent
    if agent is None:
        return
    key, who = f"data.domains[{i}].agent", f"domain {dom.name!r}: "
    errors.need(
        dom.environment is None, key, f"{who}an agent domain or an environment domain, not both (drop environment)"
    )
    cmd = agent.command
    if errors.need(
        bool(cmd) and all(isinstance(a, str) and a for a in cmd),
        f"{key}.command",
        f"{who}must be a non-empty list of non-empty strings (the program's argv), got {cmd!r}",
    ):
        errors.need(
            shutil.which(cmd[0]) is not None,
            f"{key}.command",
            f"{who}{cmd[0]!r} is not an executable (not on PATH, or not an executable file)",
        )
        for arg in cmd[1:]:
            if arg.endswith(".py"):
                errors.need(
                    os.path.isfile(arg),
                    f"{key}.command",
                    f"{who}{arg!r} is not a file (relative paths are from the directory the run starts in, "
                    f"{os.getcwd()})",
                )
    errors.need(
        math.isfinite(agent.timeout_s) and agent.timeout_s > 0,
        f"{key}.timeout_s",
        f"{who}must be a finite number > 0, got {agent.timeout_s}",
    )
    for name in ("max_completions", "max_parallel"):
        value = getattr(agent, name)
        errors.need(value >= 1, f"{key}.{name}", f"{who}must be >= 1, got {value}")
    errors.need(bool(agent.model_name), f"{key}.model_name", f"{who}must be a non-empty name")
    errors.need(
        all(isinstance(k, str) and isinstance(v, str) for k, v in agent.env.items()),
        f"{key}.env",
        f"{who}must map names to strings (quote numbers in YAML), got {agent.env!r}",
    )
    errors.need(
        dom.template is None and not dom.chat_template and dom.system_prompt is None,
        f"data.domains[{i}].template",
        f"{who}the agent writes its own messages (it gets the prompt's text on stdin); no prompt template",
    )
    check_tool_format(cfg, key, who, agent.tool_format, errors)
