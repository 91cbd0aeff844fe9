"""The daemon: composition root, endpoints, JSON API, CLI, demo and docs generator."""

from gpu_energy_exporter.daemon.lean import lean_prometheus_client

# before any module of the daemon imports prometheus_client (daemon/lean.py says why)
lean_prometheus_client()
