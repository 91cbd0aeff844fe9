"""``python -m gpu_energy_exporter`` is the same as the ``gpu-energy-exporter`` console script."""

from __future__ import annotations

import sys

from gpu_energy_exporter.daemon.cli import main

sys.exit(main())
