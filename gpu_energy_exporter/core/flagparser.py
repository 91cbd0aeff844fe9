"""The argument parser every command line of the project uses: no abbreviated flags, and "did you mean"
for a misspelled one.

``--web.listen`` is not ``--web.listen-address`` (a typo must fail, not pick a flag); ``--web.listen-adress``
gets "did you mean --web.listen-address?", the closest known flag by difflib's ratio. Pure argparse: this
module knows no flag of its own and never reads the environment.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import Any


class FlagParser(argparse.ArgumentParser):
    """argparse that takes no abbreviated flags (``--web.listen`` is not ``--web.listen-address``: a typo
    must fail, not pick a flag) and answers a misspelled one with the closest flag it knows
    (``--web.listen-adress``: did you mean ``--web.listen-address``?). The exporter, ``demo``, ``top``,
    ``runs`` and ``report`` parse with it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        super().error(did_you_mean(message, self.known_flags()))

    def known_flags(self) -> list[str]:
        """Every ``--flag`` this parser takes, read from its usage line (argparse's public view of them)."""
        return sorted(set(re.findall(r"(?<![\w-])--[A-Za-z][\w.-]*\w", self.format_usage())))


#: Below this difflib ratio a flag is too far from the typo to be what was meant.
_SUGGEST_CUTOFF = 0.75


def did_you_mean(message: str, known: Sequence[str]) -> str:
    """argparse's "unrecognized arguments: ..." with the closest known flag for each unknown ``--flag``."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return message
    guesses = []
    for arg in message[len(prefix):].split():
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            continue  # a value, or a positional argument
        close = difflib.get_close_matches(name, known, n=1, cutoff=_SUGGEST_CUTOFF)
        if close and close[0] != name:
            guesses.append((name, close[0]))
    if not guesses:
        return message
    if len(guesses) == 1:
        return f"{message}; did you mean {guesses[0][1]}?"
    return f"{message}; did you mean " + ", ".join(f"{right} (for {wrong})" for wrong, right in guesses) + "?"


__all__ = ["FlagParser", "did_you_mean"]
