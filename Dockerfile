# gpu-energy-exporter container image.
#
#   docker build -t gpu-energy-exporter .
#   docker run --rm --runtime=nvidia -p 9863:9863 -p 4318:4318 -p 4317:4317 \
#       -v gpu-energy-exporter:/var/lib/gpu-energy-exporter gpu-energy-exporter
#
# Two stages on the same slim Python image: the first builds the wheel and installs it (with the
# [kubernetes] extra for pod attribution) into a virtualenv; the second copies only that virtualenv, so
# no build tools, pip cache or source tree reach the final image. The NVIDIA container runtime injects
# the driver's libnvidia-ml.so.1 because of NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES below:
# the container sees every GPU without requesting an nvidia.com/gpu resource, so it never takes a GPU
# away from the workloads it measures. The process runs as an unprivileged user, needs no writable root
# filesystem (run it with --read-only) and writes only the run ledger under the declared volume.
# tests/test_dockerfile.py replays the build stage's commands and checks this file's structure.

ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpu_energy_exporter ./gpu_energy_exporter
RUN python -m pip wheel --no-deps --wheel-dir /wheels .
RUN python -m venv /opt/gpu-energy-exporter
RUN /opt/gpu-energy-exporter/bin/python -m pip install "$(ls /wheels/gpu_energy_exporter-*.whl)[kubernetes]"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/gpu-energy-exporter/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    GPU_ENERGY_EXPORTER_OTLP_LISTEN_ADDRESS=:4318 \
    GPU_ENERGY_EXPORTER_OTLP_GRPC_LISTEN_ADDRESS=:4317 \
    GPU_ENERGY_EXPORTER_RUNS_CSV=/var/lib/gpu-energy-exporter/runs.csv
RUN groupadd --system --gid 10001 gpu-energy-exporter \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin gpu-energy-exporter \
 && mkdir -p /var/lib/gpu-energy-exporter \
 && chown 10001:10001 /var/lib/gpu-energy-exporter
COPY --from=build /opt/gpu-energy-exporter /opt/gpu-energy-exporter
VOLUME ["/var/lib/gpu-energy-exporter"]
WORKDIR /var/lib/gpu-energy-exporter
USER 10001:10001
# 9863: /metrics and the health endpoints; 4318: the OTLP/HTTP receiver (POST /v1/metrics); 4317: the
# OTLP/gRPC receiver (MetricsService/Export).
EXPOSE 9863 4318 4317
# The slim image has no curl: the exporter's own Python checks its health endpoint, on the port that
# GPU_ENERGY_EXPORTER_WEB_LISTEN_ADDRESS sets (plain HTTP; with TLS use the orchestrator's probes).
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('GPU_ENERGY_EXPORTER_WEB_LISTEN_ADDRESS', ':9863').rsplit(':', 1)[1]; urllib.request.urlopen(f'http://127.0.0.1:{port}/-/healthy', timeout=4)"]
ENTRYPOINT ["/opt/gpu-energy-exporter/bin/gpu-energy-exporter"]
CMD []
