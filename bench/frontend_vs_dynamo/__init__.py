"""kvmesh's frontend and router against Dynamo's, side by side (``python -m
bench.frontend_vs_dynamo``; see :mod:`bench.frontend_vs_dynamo.run`)."""
