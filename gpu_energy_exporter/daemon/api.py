"""A small JSON API for the terminal view, reports and scripts: ``/api/v1/status``, ``/api/v1/runs`` and
``/api/v1/run?id=RUN``.

Built from the same in-memory state as /metrics (the last snapshot, the run ledger); never calls NVML.
The documents are described in docs/api.md; fields only get added, never renamed, within v1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core.textfmt import strict_json
from gpu_energy_exporter.engine.sampler import Sampler
from gpu_energy_exporter.http.messages import HTTPError, Request, Response


def status_document(
    sampler: Sampler,
    *,
    nvml_reason: Callable[[], str],
    carbon: Callable[[], tuple[float, float]],
    carbon_source: str,
    backend_kind: Callable[[], str],
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    snap = sampler.snapshot

    def host(name: str) -> float | None:
        return snap.value(name) if snap else None

    gpus = []
    for g in snap.gpus if snap else ():
        r = g.reading
        gpus.append({
            "index": g.identity.index, "uuid": g.identity.uuid, "name": g.identity.name, "up": g.up,
            "energy_method": g.identity.energy_method, "energy_j": g.energy_j,
            "power_w": r.power_instant_w if r else None,
            "power_average_w": r.power_average_w if r else None,
            "power_limit_w": r.power_limit_w if r else None,
            "utilization": r.util_gpu_ratio if r else None,
            "memory_used_bytes": r.memory_used_bytes if r else None,
            "memory_total_bytes": r.memory_total_bytes if r else None,
            "temperature_c": r.temperature_gpu_c if r else None,
            "idle_power_w": g.idle_power_w, "last_sample_age_s": (clock() - g.last_good) if g.last_good else None,
            "error": g.error,
        })
    intensity, pue = carbon()
    reason = nvml_reason()
    return {
        "version": __version__,
        "timestamp": snap.timestamp if snap else None,
        "backend": backend_kind(),
        "simulated": backend_kind() == "simulated",
        "nvml": {"available": not reason, "reason": reason},
        "gpus": gpus,
        "host": {
            "cpu_utilization": host("gpuenergy_host_cpu_utilization_ratio"),
            "memory_total_bytes": host("gpuenergy_host_memory_total_bytes"),
            "memory_available_bytes": host("gpuenergy_host_memory_available_bytes"),
            "memory_critical_bytes": host("gpuenergy_host_memory_critical_bytes"),
        },
        "carbon": {"intensity_g_per_kwh": intensity, "pue": pue, "source": carbon_source},
    }


def _json(doc: Any, status: int = 200) -> Response:
    # strict JSON for every client (NaN/Infinity would make strict parsers reject the whole document)
    return Response(status, (strict_json(doc, default=str) + "\n").encode(),
                    {"Content-Type": "application/json", "Cache-Control": "no-store"})


def api_routes(
    status: Callable[[], Mapping[str, Any]],
    runs: Callable[[], list[dict[str, Any]]],
    run: Callable[[str], dict[str, Any] | None],
) -> dict[tuple[str, str], Callable[[Request], Response]]:
    def get_status(_req: Request) -> Response:
        return _json(status())

    def get_runs(_req: Request) -> Response:
        return _json({"runs": runs()})

    def get_run(req: Request) -> Response:
        run_id = (parse_qs(req.query).get("id") or [""])[0]
        if not run_id:
            raise HTTPError(400, "missing ?id=RUN_ID")
        doc = run(run_id)
        if doc is None:
            return _json({"error": f"unknown run {run_id!r}: see /api/v1/runs for the runs this exporter knows"},
                         404)
        return _json(doc)

    return {("GET", "/api/v1/status"): get_status, ("GET", "/api/v1/runs"): get_runs,
            ("GET", "/api/v1/run"): get_run}
