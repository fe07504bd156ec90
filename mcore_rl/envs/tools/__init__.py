"""Tools an environment offers the policy: a call is checked against the tool's JSON schema, run under a
timeout, and answered with a tool message, never an exception (`toolset.Toolset`)."""

from mcore_rl.envs.tools.toolset import Tool, ToolError, ToolLimits, ToolRun, Toolset, ToolTimeout

__all__ = ["Tool", "ToolError", "ToolLimits", "ToolRun", "ToolTimeout", "Toolset"]
