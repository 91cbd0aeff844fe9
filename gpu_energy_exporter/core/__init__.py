"""Core: metric specs and catalogue, GPU and snapshot state in base units (``state``), energy accounting
primitives, errors, configuration parsing and text formatting. Imports nothing else of the package."""
