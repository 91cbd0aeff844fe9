"""Core: metric specs and catalogue, energy accounting primitives, errors, configuration parsing and
text formatting. Imports nothing else of the package."""
