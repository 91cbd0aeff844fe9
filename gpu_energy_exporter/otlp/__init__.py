"""OTLP inside the exporter: the receiver (training processes push, ``/metrics`` exposes) and the pusher
(the node's readings pushed to an OpenTelemetry endpoint). Import the module that does the job:

- ``naming``: OpenTelemetry names, units and attribute values to Prometheus names and label values (pure).
- ``points``: the translated ``Point`` / ``Batch``, the per-point ``Limits`` and series sizes (pure).
- ``wire``: the request type protobuf pushes are parsed into (OTLP's, data-point attributes kept as bytes).
- ``census``: what a request would make, counted before it is parsed, and the budgets it must fit (pure).
- ``decoding``: request bodies to messages: inflating within the limit, the census, protobuf and JSON (pure).
- ``translate``: a decoded ``ExportMetricsServiceRequest`` to a ``Batch``, every limit applied.
- ``temporality``: delta and cumulative streams, restarts and histogram layouts into exposed values (pure).
- ``admission``: the store's bounds and name rules, as refusals with their flag (pure).
- ``series``: the store's families and series and their encoded exposition lines.
- ``selfmetrics``: the receiver's ``gpuenergy_otlp_*`` counters.
- ``store``: ``TrainingStore``, the bounded, locked series the pushes build, collected on the scrape path;
  ``gate`` what it asks the run ledger before storing a request's points (who may change which run).
- ``identify``: who pushed a request (tokens and tenants, the kernel's view of the connection, trusted
  forwarders: docs/security.md).
- ``receiver``: ``POST /v1/metrics`` handling (``ExportHandler``) and a standalone server
  (``OTLPReceiver``, on a TCP port or the OTLP Unix socket); the only module here that imports the HTTP
  server.
- ``grpcreceiver``: ``GRPCReceiver``, ``MetricsService/Export`` over gRPC into ``ExportHandler.store_body``
  (the one path after a body is read); ``grpctls`` its TLS credentials; ``grpc_admission`` its admission (calls
  at once, the slowest cut); ``grpc_port_holder`` the plain sockets that hold its port until the first connection
  loads grpc. Only ``grpcreceiver`` and ``grpctls`` import grpc, when the server is built.
- ``conventions``: which of the node's series are pushed, named after the OpenTelemetry hardware
  semantic conventions (pure).
- ``push``: ``OTLPPusher``, the thread and the OpenTelemetry SDK exporter that push them.

Importing this package imports none of them: it starts nothing, never touches NVML and never loads the
HTTP server.
"""
