"""kvmesh's encoder-cache (EC) connector for vLLM: E -> P embeddings over NIXL (EPD).

- :mod:`.connector`: the vLLM facade ``KvmeshECConnector`` (flow and hooks).
- :mod:`.scheduler` / :mod:`.worker`: its scheduler halves (E: slots and leases;
  consumer: NIXL READs) and worker half (copies to and from vLLM's encoder cache).
- :mod:`.core`: pure parts (settings, descriptors, slot headers, slots, leases).
- :mod:`.transport`: the shared region and the NIXL endpoint.
- :mod:`.metadata`: what crosses vLLM's scheduler -> worker boundary.
- :mod:`.configs`: ``ec_transfer_config`` builders (NIXL, or vLLM's ECExampleConnector).
"""
