"""KV indexer benchmark: kvmesh's ``KvIndex`` against Dynamo's ``RadixTree`` on one workload.

Run ``python -m bench.indexer --help``.
"""
