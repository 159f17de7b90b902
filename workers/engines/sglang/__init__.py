"""SGLang 0.5.23 as a kvmesh engine.

- :mod:`.server`: stdlib-only helpers importable from ``.venv`` (where ``.sglvenv`` is,
  the server command line and its environment).
- :mod:`.launch`: runs inside ``.sglvenv``; installs :mod:`.sgl_kernel_shim` and
  :mod:`.cpu_patches`, then SGLang's own HTTP server.
- :mod:`.engine`: the kvmesh :class:`~workers.engines.base.Engine` adapter over that server.
"""
