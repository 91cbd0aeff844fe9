"""Collectors: one per source (GPU, host, RAPL, carbon, Kubernetes pods), each reading only devices/,
reference/, kubernetes/ and core/. A collector never renders HTTP and never waits on another."""
