"""Tools on top of the daemon, never imported by it: the `demo` sub-command (simulated GPUs and training runs)
and the reference-docs generator (`python -m gpu_energy_exporter.tools.docgen`)."""
