"""kvmesh store benchmark (``python -m bench.store``); see :mod:`bench.store.run`."""
