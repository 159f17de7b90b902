"""AFD benchmarks: ``python -m bench.afd.transport`` (per-layer activation round trips)."""
