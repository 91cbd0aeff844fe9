"""Import ``prometheus_client`` without its package ``__init__``: the daemon uses its metric types and
registry, not its HTTP servers, push gateway or WSGI/ASGI apps.

``import prometheus_client.core`` runs ``prometheus_client/__init__.py`` first, and that imports
``prometheus_client.exposition``: ``http.server``, ``urllib.request``, ``wsgiref``, ``gzip`` and, through
``http.client``, ``ssl`` (OpenSSL's libraries): about 10 of the daemon's 40 MB, for code it never runs
(it serves its own HTTP and encodes its own exposition, ``core.encoder``).

``lean_prometheus_client()`` registers the package as a module whose ``__path__`` is the real package's,
without running its ``__init__``: submodules (``core``, ``registry``, ``metrics_core``, ...) import as
usual, and the first access to any other name (``prometheus_client.CollectorRegistry``,
``from prometheus_client import start_http_server``) runs the real ``__init__`` then, so every name the
package exports still works, only later. It changes nothing when ``prometheus_client`` is already imported,
and must run before anything imports it: the process's entry point (``daemon.cli.main``) calls it, nothing
calls it at import. Why it stays (issue 32 asked that it go or be justified by a figure): the daemon with 8
fake H100s at the defaults holds 36.4 MB with it and 42.8 MB without (``docs/benchmarks.md``, "The daemon's
imports"), against a 40 MB target; the modules it avoids load the same on a real driver.

``few_malloc_arenas()`` caps glibc's malloc arenas at two (``mallopt(M_ARENA_MAX, 2)``), as
``MALLOC_ARENA_MAX=2`` would: glibc gives each thread that allocates its own arena, and the daemon's threads
(sampler, HTTP, receiver, ledger, ...) each kept a partly used one: about 2 MB of its RSS for no speed it
needs (they are mostly idle, and Python's small objects come from its own allocator under the GIL).
A ``MALLOC_ARENA_MAX`` in the environment wins; elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

NAME = "prometheus_client"


def lean_prometheus_client() -> None:
    if NAME in sys.modules:
        return
    spec = importlib.util.find_spec(NAME)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed, or not a package: the daemon's own import will say so
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def __getattr__(attr: str) -> Any:  # PEP 562: only names the module does not have yet
        if attr.startswith("__"):
            raise AttributeError(attr)
        if importlib.util.find_spec(f"{NAME}.{attr}") is not None:
            return importlib.import_module(f"{NAME}.{attr}")  # a submodule: import just that
        _load_whole(module, loader)
        return getattr(module, attr)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[NAME] = module


def _load_whole(module: ModuleType, loader: Any) -> None:
    if module.__dict__.pop("__getattr__", None) is not None:
        loader.exec_module(module)


M_ARENA_MAX = -8  # glibc's malloc.h


def few_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas at two, before the daemon starts its threads. True when it was set."""
    import os

    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_ARENA_MAX, 2))
