"""The HTTP layer: a bounded selector server and the exporter-toolkit style web configuration."""
