"""The daemon: composition root, endpoints, JSON API, CLI, demo and docs generator."""
