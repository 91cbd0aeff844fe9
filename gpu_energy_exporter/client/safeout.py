"""The workstation commands' output streams, made safe for a terminal: every text ``runs``, ``top`` and
``report`` write to stdout or stderr (tables, CSV, JSON, progress lines, errors) goes through
``core.textfmt.printable``, so no escape sequence (ESC, CSI, OSC), bell or other C0/C1 control character that
came in a run id, a label, a note or an error message (all of which a pushing client or a server chooses)
reaches the terminal, whatever the format. Tabs and line feeds are kept.

A wrapper around the caller's stream: it writes only what it is given, and never opens anything itself.
"""

from __future__ import annotations

from typing import IO, Any

from gpu_energy_exporter.core.textfmt import printable


class Printable:
    """``stream`` with control characters stripped from everything written to it (``printable``)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, ...: the stream's own
        return getattr(self._stream, name)


def printable_stream(stream: IO[str]) -> IO[str]:
    """``stream`` wrapped once in ``Printable``."""
    if isinstance(stream, Printable):
        return stream
    return Printable(stream)  # type: ignore[return-value]
