"""Number formatting, JSON clean-up and safe text for outputs other programs read (CSV cells, terminals, logs,
Markdown), shared by the ledger, ``runs``, ``top``, ``report`` and the log formatters.

Pure functions of their arguments: this module never writes anything itself.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import re
from collections.abc import Iterable
from typing import Any


def fmt_num(value: float | None) -> str:
    """Readable at any magnitude: 12,345 / 12.35 / 0.0123."""
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    if value == 0:
        return "0"
    return f"{value:#.3g}"


def json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null (recursively through dicts and lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def strict_json(doc: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``doc`` as strict JSON: NaN and infinities become null (``json_safe``) and any left
    (a float subclass, a ``default=`` result) raise rather than write a bare ``NaN``/``Infinity`` that strict
    parsers reject."""
    return json.dumps(json_safe(doc), allow_nan=False, **kwargs)


# ----------------------------------------------------------------------------------------------------
# outputs other programs read: spreadsheets, terminals, logs, Markdown (issue 20, item 8)

#: What a spreadsheet takes for the start of a formula (OWASP "CSV Injection": ``=``, ``+``, ``-``, ``@``,
#: and tab and carriage return, which some spreadsheets skip before looking at the first character).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def csv_cell(value: str) -> str:
    """A CSV cell a spreadsheet shows as text: a value that starts like a formula gets a leading ``'``
    (OWASP's rule); plain numbers (``-12.5``) are left alone, they compute nothing. Call it on every text
    cell written to a CSV file or stream (the ledger's ``runs.csv``, ``runs --format csv``)."""
    if value.startswith(_FORMULA_START) and not _PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


def csv_record(cells: Iterable[Any]) -> str:
    """One CSV record, quoted as RFC 4180 requires: a cell holding a separator, a quote, a carriage return or
    a line feed is quoted (quotes doubled), so every CSV reader reads the cell back whole; the record ends with
    ``\n``. (Python's ``csv`` module quotes only the characters of its line terminator: with ``\n`` a cell with
    a bare ``\r`` was written unquoted, and readers split the row there.) Text cells should have been through
    ``csv_cell`` first."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\r\n").writerow(list(cells))
    return buf.getvalue()[:-2] + "\n"


# C0 controls but tab and newline, DEL, and the C1 controls (CSI, OSC... in 8-bit form): what makes a
# terminal move the cursor, change its title, ring or run an escape sequence.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROLS_AND_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str, *, keep_newlines: bool = True) -> str:
    """``text`` without control characters (ESC, BEL, CR, backspace, C1 ...), for a terminal or a log
    line. Tabs and (with ``keep_newlines``) newlines are kept; without it they are removed too."""
    return (_CONTROLS if keep_newlines else _CONTROLS_AND_BREAKS).sub("", text)


# What makes Markdown of text: emphasis, code, links and images (``[``, ``]``: without them ``(...)`` and ``!``
# are plain), table cells, strike-through, and a block marker (heading, list, quote) at the start.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")
_MD_BLOCK_START = re.compile(r"^(\s*)(\d*)([#+\-=>.)])(?=\s|$)")


def md_text(text: str, *, code_spans: bool = False, block: bool = True) -> str:
    """``text`` as literal Markdown: HTML is escaped as entities (no raw ``<script>`` reaches a renderer
    that passes HTML through), Markdown punctuation is backslash-escaped, control characters and line
    breaks removed. ``code_spans``: backticks are kept (text the report itself wrote, with `code`).
    ``block``: the text starts a block (a heading, paragraph or list item), so a leading ``#``, ``-``,
    ``+``, ``>`` or ``1.`` is escaped too (not needed in a table cell)."""
    out = html.escape(printable(text, keep_newlines=False), quote=False)
    if code_spans:
        out = "`".join(_MD_SPECIAL.sub(r"\\\1", part) for part in out.split("`"))
    else:
        out = _MD_SPECIAL.sub(r"\\\1", out)
    if not block:
        return out
    start = _MD_BLOCK_START.match(out)
    if start is None or bool(start.group(2)) != (start.group(3) in ".)"):
        return out  # digits only before "." or ")" (an ordered list), the other markers alone
    return out[:start.start(3)] + "\\" + out[start.start(3):]
