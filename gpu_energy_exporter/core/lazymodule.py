"""A module imported at its first use rather than where it is named (``importlib.util.LazyLoader``).

For the few standard modules a daemon component names at its top but needs only once it runs: ``asyncio``
in the OTLP/gRPC receiver, which holds its port with plain sockets until a client connects and loads asyncio
(and with it ``ssl``: about 9 MB of resident memory) and grpc only then. ``lazy("asyncio")`` gives the
module itself when it is already imported; else a module object that imports it on the first attribute
access. Under ``TYPE_CHECKING`` name the module with a plain import so type checkers see it.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
