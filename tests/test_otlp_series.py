"""The training store's line encoding (``otlp.series.encode_lines``: value texts cached) writes exactly what
``core.encoder.lines`` writes."""

from __future__ import annotations

import math

from gpu_energy_exporter.core import encoder
from gpu_energy_exporter.otlp import series

VALUES = [0.0, -0.0, 1.0, 1, 3e-4, 1e21, -1e21, 123456789.0, 2.5, math.inf, -math.inf, math.nan, 0.1 + 0.2,
          -5.0, 1e-300, 42.0]


def test_lines_equal_the_encoders_bytes_cached_or_not() -> None:
    heads = tuple(f"m{i}{{a=\"b\"}} ".encode() for i in range(len(VALUES)))
    for _ in range(3):  # the first time fills the cache
        assert series.encode_lines(heads, tuple(VALUES)) == encoder.lines(heads, VALUES)
        for v in VALUES:
            assert series.encode_lines((b"x ",), (v,)) == encoder.lines((b"x ",), (v,))
    assert series.encode_lines((b"x ",), (-0.0,)) == b"x -0.0\n"
    assert series.encode_lines((b"x ",), (0.0,)) == b"x 0.0\n"


def test_the_value_cache_is_bounded() -> None:
    for i in range(series._VALUE_TEXT_MAX * 2):
        series.encode_lines((b"x ",), (float(i) + 0.5,))
    assert len(series._VALUE_TEXT) <= series._VALUE_TEXT_MAX
