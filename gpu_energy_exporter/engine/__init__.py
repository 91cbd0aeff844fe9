"""The engine: the sampler that builds a snapshot, and the one exposition path that renders it."""
