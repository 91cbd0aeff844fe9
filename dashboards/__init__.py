"""Grafana dashboards and Prometheus rules of gpu-energy-exporter, as code.

``python -m dashboards.build`` regenerates ``dashboards/*.json`` and the generated sections of
``docs/dashboards.md``; the rules live in ``dashboards/rules/*.yaml`` and their promtool tests in
``dashboards/tests/*.yaml``. Nothing here talks to Grafana or Prometheus.
"""
