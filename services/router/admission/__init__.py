"""Admission control, a library of the router.

- :mod:`.core`: the pure admission policies (``early`` = Mooncake-style early rejection,
  ``current_load``) over a cluster-state snapshot; no I/O, no clock of its own.
- :mod:`.live`: the router's in-flight bookkeeping (:class:`~.live.Flight`) turned into
  that snapshot for each new request (:class:`~.live.RouterAdmission`).
"""
