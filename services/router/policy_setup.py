"""The router's policy registry built from its files (the I/O the pure registry leaves out).

Used by ``main.py`` (live router), the offline replay and tests. Contract:

- :func:`packaged_profiles_text` is the packaged ``services/router/profiles.yaml``;
  :func:`read_profiles_file` the text of a ``--profiles FILE`` (:class:`ProfileError`
  when it cannot be read).
- :func:`ttft_args` is the arg loader of the ``ttft`` policy: it turns YAML args into
  :class:`~services.router.policies.ttft.TtftPolicy` keywords by loading the perf model
  they name: ``perf_model`` (``mocker`` = Dynamo's mocker polynomials, the default, else
  a JSON table path; :func:`~services.common.perf_model.load_perf_model`), ``speedup``
  (> 0, default 1, divides the mocker's times) and ``kv_capacity_tokens`` (the mocker's
  capacity, default 16384·16) become one loaded ``perf_model``; a ``perf_model`` that is
  already a model object is kept as is. The other args pass unchanged. ValueError for
  ``speedup <= 0``; OSError or ValueError for an unreadable or bad table.
- :func:`default_registry(profiles_file=None, context=None)` is a registry with every
  built-in policy and plugin, :data:`ARG_LOADERS`, the packaged profiles, then the
  profiles of ``profiles_file`` (same names replace the packaged ones), and ``context``
  as the registry's factory context (e.g. ``{"clock": clock}``; see
  ``policies/registry.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from services.common.perf_model import load_perf_model
from services.router.policies.profile import ProfileError
from services.router.policies.registry import ArgLoader, PolicyRegistry, register_all

DEFAULT_PROFILES = "profiles.yaml"
DEFAULT_KV_CAPACITY_TOKENS = 16384 * 16


def packaged_profiles_text() -> str:
    """The packaged default profiles (``services/router/profiles.yaml``)."""
    return resources.files("services.router").joinpath(DEFAULT_PROFILES).read_text()


def read_profiles_file(path: str | Path) -> str:
    """The text of a profiles file; ProfileError when it cannot be read."""
    p = Path(path)
    try:
        return p.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profiles file {p}: {exc}") from None


def ttft_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """A TTFT policy's YAML args with the perf model loaded (see the module docstring)."""
    out = dict(args)
    spec = out.pop("perf_model", "mocker")
    speedup = out.pop("speedup", 1.0)
    capacity = out.pop("kv_capacity_tokens", DEFAULT_KV_CAPACITY_TOKENS)
    if not isinstance(spec, str):
        out["perf_model"] = spec
        return out
    if not float(speedup) > 0:
        raise ValueError(f"speedup must be > 0, got {speedup!r}")
    out["perf_model"] = load_perf_model(spec, float(speedup), int(capacity))
    return out


ARG_LOADERS: Mapping[str, ArgLoader] = {"ttft": ttft_args}


def default_registry(profiles_file: str | Path | None = None,
                     context: Mapping[str, Any] | None = None) -> PolicyRegistry:
    """Built-in policies, packaged profiles and ``profiles_file``'s (see the module
    docstring)."""
    reg = register_all(PolicyRegistry(context, ARG_LOADERS))
    reg.load_profiles(packaged_profiles_text(), f"services/router/{DEFAULT_PROFILES}")
    if profiles_file:
        reg.load_profiles(read_profiles_file(profiles_file), str(profiles_file), replace=True)
    return reg
