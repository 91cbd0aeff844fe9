"""Kubernetes pod attribution: which pod and container holds which GPU, and how much energy each used.

- ``podresources.proto`` is the kubelet pod-resources v1 API (the wire contract, copied field for field
  from Kubernetes); ``podresources_pb2.py``, ``podresources_pb2.pyi`` and ``podresources_pb2_grpc.py``
  are generated from it and committed. Regenerate them from the repository root with exactly::

      .venv/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \\
          gpu_energy_exporter/collectors/kubernetes/podresources.proto

  Running protoc from the repository root with ``-I.`` makes the generated modules import each other as
  ``gpu_energy_exporter.collectors.kubernetes.podresources_pb2``, so no hand edit is needed. The generated code
  checks its runtime: it needs protobuf and grpcio at least as new as the grpcio-tools that generated it
  (the versions are written at the top of the generated files).
- ``podresources`` is the client: it lists the kubelet's assignments on its own thread, on an interval,
  never per scrape, and turns device ids into GPU and MIG UUIDs.
- ``attribution`` is pure arithmetic: it integrates each GPU's energy deltas to the containers holding
  it.

Importing this package never imports grpc; only ``podresources`` does, and only the ``kubernetes``
collector imports that, so the exporter runs without the ``[kubernetes]`` extra installed.
"""

from __future__ import annotations
