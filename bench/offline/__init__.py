"""Offline virtual-clock replay (``kvmesh bench replay --offline``) on kvmesh's pure cores.

- :mod:`.config`: :class:`SimConfig`, every knob of one run.
- :mod:`.sim`: the discrete-event simulation (mock engine core, router core, indexer
  core, event translator, admission core) on a virtual clock.
- :mod:`.policies`: policy construction for the simulation, plus the TTFT-aware policy.
- :mod:`.admission`: the adapter from simulation state to :mod:`services.router.admission.core`.
- :mod:`.sweep`: arrival speed-up sweeps, SLO share and capacity by bisection.
- :mod:`.dynamo`: Dynamo's ``run_trace_replay`` on the same trace, in a subprocess.
- :mod:`.report`: JSON and PNG output; :mod:`.compare`: live vs offline metrics.
- :mod:`.timeline`: ``--timeline``, per-interval queues, KV use and preemptions per worker.
- :mod:`.topology`: ``--search-topology N``, the best capacity of every split of N workers.
- :mod:`.cli`: ``main(argv)``, the command line (``python -m bench.offline``).
"""
