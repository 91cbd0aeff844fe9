"""The daemon: composition root, configuration, endpoints, JSON API and CLI."""
