"""The run metrics of `mcore-rl train`; they live in `mcore_rl/observe/` (shared with `mcore-rl sft`),
named here for the callers that import them from the runtime."""

from mcore_rl.observe.plot import domains_of, plot_curves  # noqa: F401
from mcore_rl.observe.sinks import MetricsWriter, read_metrics  # noqa: F401
