"""Observability of `mcore-rl sft` and `mcore-rl train`: metrics sinks (`sinks.py`), per-phase
timers (`timers.py`), tokens/s and MFU per device (`throughput.py`), torch.profiler traces and memory
snapshots of chosen steps (`profiling.py`), time to first step (`ttfs.py`) and the PNG curves of
`mcore-rl plot` (`plot.py`). Below `train` and `runtime` in the data flow: it imports neither.
"""
