"""KV-cache handoff between engines (prefill -> decode).

- :mod:`workers.kv.nixl`: vLLM's NIXL connectors (pull = ``NixlConnector``, push =
  ``NixlPushConnector``): their ``kv_transfer_config``, the environment the EngineCore
  process needs, and the per-request ``kv_transfer_params`` a proxy passes to P and D.
- :mod:`workers.kv.layout`: the KV layout string two engines must share to hand off.
- :mod:`workers.kv.configs`: every ``kv_transfer_config`` the worker builds (NIXL, the
  kvmesh store, both) and the environment its EngineCore gets.
- :mod:`workers.kv.store_connector`: the kvmesh store connector (halves in
  :mod:`workers.kv.store`).
"""
