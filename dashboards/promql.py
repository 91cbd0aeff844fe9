"""Just enough PromQL lexing to check the dashboards and rules: metric names, Grafana variables, normal form.

Used by the build (the docs' metric index) and by the tests (every metric name must be one the code
produces; every dashboard expression must have a promtool test). It is not a PromQL parser: it never
decides whether an expression is valid (promtool does that) and never evaluates anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

_TOKEN = re.compile(
    r"""
      (?P<ws>\s+)
    | (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<dur>(?:\d+(?:ms|s|m|h|d|w|y))+(?![A-Za-z0-9_]))
    | (?P<num>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<var>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])
    | (?P<ident>[A-Za-z_][A-Za-z0-9_:]*)
    | (?P<punct>[{}()\[\],@:])
    | (?P<op>=~|!~|==|!=|<=|>=|[-+*/%^<>=])
    """,
    re.VERBOSE,
)

#: Words that are PromQL syntax, not metric names (``inf``/``nan`` are number literals).
_KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "offset", "inf", "nan",
})
#: Keywords followed by a parenthesised list of label names.
_LABEL_LIST = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


def tokens(expr: str) -> Iterator[tuple[str, str]]:
    """(kind, text) for every token of ``expr``, whitespace included; raises ValueError on a character
    that no PromQL token starts with."""
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"unexpected {expr[pos]!r} at {pos} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        yield kind, m.group()
        pos = m.end()


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects.

    Skips label matchers (``{...}``), range and subquery brackets (``[...]``), label lists after
    ``by``/``on``/... and function names (an identifier followed by ``(``).
    """
    toks = [(k, t) for k, t in tokens(expr) if k != "ws"]
    names: set[str] = set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        if text in ("{", "["):
            i = _skip_group(toks, i)
            continue
        if kind == "ident":
            following = toks[i + 1][1] if i + 1 < len(toks) else ""
            word = text.lower()
            if word in _LABEL_LIST:
                i += 1
                if i < len(toks) and toks[i][1] == "(":
                    i = _skip_group(toks, i)
                continue
            # A name followed by "(" is a function; by "by"/"without", an aggregation (sum by (x) (...)).
            if word not in _KEYWORDS and following != "(" and following.lower() not in ("by", "without"):
                names.add(text)
        i += 1
    return names


def _skip_group(toks: list[tuple[str, str]], i: int) -> int:
    """Index just past the bracket group opening at ``toks[i]``."""
    pairs = {"{": "}", "[": "]", "(": ")"}
    opener = toks[i][1]
    depth = 0
    for j in range(i, len(toks)):
        if toks[j][1] == opener:
            depth += 1
        elif toks[j][1] == pairs[opener]:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced {opener!r} in {' '.join(t for _, t in toks)!r}")


_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<arg>.*)\)\s*$", re.DOTALL)


def variable_query_metric_names(query: str) -> set[str]:
    """Metric names in a Grafana Prometheus variable query: ``label_values(<selector>, <label>)``."""
    m = _LABEL_VALUES.match(query)
    if m is None:
        return metric_names(query)
    arg = m.group("arg")
    # The last top-level comma separates the selector from the label name.
    depth, split = 0, -1
    for kind, text, start in _positions(arg):
        if kind == "punct" and text in "{([":
            depth += 1
        elif kind == "punct" and text in "})]":
            depth -= 1
        elif text == "," and depth == 0:
            split = start
    return metric_names(arg[:split]) if split >= 0 else set()


def _positions(expr: str) -> Iterator[tuple[str, str, int]]:
    pos = 0
    for kind, text in tokens(expr):
        yield kind, text, pos
        pos += len(text)


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace Grafana variables (``$name``, ``${name}``, ``[[name]]``) by ``values[name]``.

    Raises KeyError for a variable without a value, so a new variable cannot slip past the tests.
    """
    out = []
    for kind, text in tokens(expr):
        if kind == "var":
            name = text.strip("$[]{}").split(":")[0]
            out.append(values[name])
        elif kind == "str" and "$" in text:
            out.append(_substitute_in_string(text, values))
        else:
            out.append(text)
    return "".join(out)


_VAR_IN_STRING = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def _substitute_in_string(text: str, values: Mapping[str, str]) -> str:
    return _VAR_IN_STRING.sub(lambda m: values[m.group(1) or m.group(2) or m.group(3)], text)


def normalize(expr: str) -> str:
    """The expression's tokens separated by single spaces, for comparing two spellings of one query."""
    return " ".join(text for kind, text in tokens(expr) if kind != "ws")
