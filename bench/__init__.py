"""Benchmarks and accuracy figures for gpu-energy-exporter, side by side with the tools users would pick
instead (Zeus, CodeCarbon, nvitop-exporter, hand-written NVML polling threads).

``python -m bench`` runs everything (about 15 minutes), ``python -m bench --quick`` is a smoke run (under a
minute, figures not meaningful), ``python -m bench.<module>`` runs one benchmark. Each prints Markdown
tables with the command and the machine; docs/benchmarks.md holds a full run's figures and what they mean.
Benchmarks run on the fake NVML library from tests/fakenvml, never on a real driver, and never assert a
timing: the test suite only smoke-runs the quick mode.

Shared with the tests (and imported from there, not copied): ``tests/fakenvml`` (the fake library) and
``tests/helpers.py`` (child processes, the exporter process wrapper, free ports, exposition parsing).
Importing this package puts ``tests/`` on ``sys.path`` for them; helpers.py never needs pytest.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
