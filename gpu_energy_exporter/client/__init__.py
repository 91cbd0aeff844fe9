"""Workstation commands: clients of the exporter's JSON API and /metrics (top, runs, report)."""
