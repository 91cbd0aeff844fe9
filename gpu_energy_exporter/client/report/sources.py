"""Where ``gpu-energy-exporter report`` reads a run besides Prometheus: a JSON summary file the run ledger
wrote, or a running exporter's ``/api/v1/run`` (through the one exporter client, ``client/api.py``). Both
are the ledger's run document, read by ``from_ledger_document``.

This module only reads: it never writes, never plots, and never contacts anything but the given URL.
"""

from __future__ import annotations

import json
from typing import Any

from gpu_energy_exporter.client.api import DEFAULT_URL, RUN_PATH, STATUS_PATH, ExporterClient, ExporterUnreachable
from gpu_energy_exporter.client.report.run import ReportError, RunData, num
from gpu_energy_exporter.core.runs_schema import SUMMARY_SCHEMA


def from_ledger_document(doc: dict[str, Any], source: str) -> RunData:
    """A run from the ledger's run document (``/api/v1/run`` or a JSON summary file)."""
    if not isinstance(doc, dict) or "run_id" not in doc:
        raise ReportError(f"{source} is not a run document of the gpu-energy-exporter run ledger")
    if doc.get("schema") not in (None, SUMMARY_SCHEMA):
        raise ReportError(f"{source} has schema {doc.get('schema')!r}; this version reads {SUMMARY_SCHEMA!r}")
    gpus = [g for g in doc.get("gpus") or [] if isinstance(g, dict)]
    order = [str(u) for u in doc.get("timeline_gpus") or [g.get("uuid") for g in gpus]]
    by_uuid = {g.get("uuid"): g for g in gpus}
    run = RunData(run_id=str(doc["run_id"]), source=source, summary=dict(doc),
                  gpus=[by_uuid.get(u) or {"uuid": u, "name": ""} for u in order],
                  start=num(doc.get("start_unix")), end=num(doc.get("end_unix")))
    run.power_w = [[] for _ in order]
    for p in doc.get("timeline") or []:
        t = num(p.get("t"))
        if t is None:
            continue
        run.t.append(t)
        powers = p.get("power_w") or []
        for i in range(len(order)):
            run.power_w[i].append(num(powers[i]) if i < len(powers) else None)
        run.energy_j.append(num(p.get("energy_j")))
        run.tokens.append(num(p.get("tokens")))
        run.steps.append(num(p.get("steps")))
        run.loss.append(num(p.get("loss")))
        run.vram_bytes.append(num(p.get("vram_used_bytes")))
        run.host_available_bytes.append(num(p.get("host_memory_available_bytes")))
    if run.start is None and run.t:
        run.start = run.t[0]
    return run


def load_file(path: str) -> RunData:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ReportError(f"no such file {path!r}: RUN is a run id (the first column of `gpu-energy-exporter "
                          "runs`) or a JSON summary the run ledger wrote (runs/<run id>.json beside its "
                          "--runs.csv)") from None
    except (OSError, ValueError) as exc:
        raise ReportError(f"cannot read the run summary {path!r}: {exc}") from None
    return from_ledger_document(doc, path)


def load_from_exporter(client: ExporterClient, run_id: str) -> RunData:
    try:
        doc = client.get(RUN_PATH, {"id": run_id})
    except ExporterUnreachable as exc:
        text = str(exc)
        if "unknown run" in text:
            url = "" if client.base_url == DEFAULT_URL else f" --url {client.base_url}"
            text = (f"unknown run {run_id!r} at {client.base_url}: `gpu-energy-exporter runs{url}` lists the runs "
                    "it knows (RUN is the first column). The exporter keeps finished runs for 15 minutes: for "
                    "older runs pass the JSON summary file (runs/<run id>.json beside its --runs.csv) or "
                    "--prometheus URL")
        raise ReportError(text) from None
    run = from_ledger_document(doc, f"exporter {client.base_url}")
    try:
        status = client.get(STATUS_PATH)
        run.host_critical_bytes = num((status.get("host") or {}).get("memory_critical_bytes"))
    except (ExporterUnreachable, AttributeError):
        pass  # the threshold line is a nicety
    return run
