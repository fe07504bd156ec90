"""The run metrics of `mcore-rl train`; they live in `mcore_rl/observe/` (shared with `mcore-rl sft`),
named here for the callers that import them from the runtime."""

from mcore_rl.observe.plot import domains_of, plot_curves
from mcore_rl.observe.sinks import MetricsWriter, read_metrics

__all__ = ["MetricsWriter", "domains_of", "plot_curves", "read_metrics"]
