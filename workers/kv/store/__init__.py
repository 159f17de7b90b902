"""The kvmesh store connector's parts (the vLLM facade is :mod:`workers.kv.store_connector`).

- :mod:`.planner`: vLLM-free planning (block counts and hashes in, load/save jobs out).
- :mod:`.scheduler` / :mod:`.worker`: the connector's scheduler and worker halves.
- :mod:`.metadata`: what crosses vLLM's scheduler ↔ worker boundary.
- :mod:`.l1`: the L1 CPU pool in front of the store client.
"""
