"""A module imported at its first use rather than where it is named.

For the few standard modules a daemon component names at its top but needs only once it runs: ``asyncio``
in the OTLP/gRPC receiver, which holds its port with plain sockets until a client connects and loads asyncio
(and with it ``ssl``: about 7 MB of resident memory) and grpc only then. ``lazy("asyncio")`` is a stand-in
that imports the module at its first attribute access and keeps each attribute it handed out.

It is not registered in ``sys.modules`` (``importlib.util.LazyLoader`` would be): other code looks there to
learn whether a module is in use, and touching it would load it (Python 3.12's ``logging`` asks
``sys.modules["asyncio"]`` for the current task on every log record). Under ``TYPE_CHECKING`` name the module
with a plain import so type checkers see it.
"""

from __future__ import annotations

import importlib
from typing import Any


class _Lazy:
    def __init__(self, name: str) -> None:
        self.__name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self.__name), attr)
        setattr(self, attr, value)  # later lookups find it here, without __getattr__
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self.__name!r}>"


def lazy(name: str) -> Any:
    return _Lazy(name)
