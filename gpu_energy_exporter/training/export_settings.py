"""Where and as whom a run reports: ``ExportSettings``; and ``run_keywords``, which sorts the keyword form
of ``start_run`` and the callbacks (``start_run(model=..., endpoint=...)``) into a ``RunMetadata`` and an
``ExportSettings``.

``RunMetadata`` (``metadata.py``) says what the run is; ``ExportSettings`` says where its points go
(endpoint, headers, timing) and what placement labels them (GPUs, rank, world size). Their fields are the
one list of ``start_run``'s keywords: ``start_run``, ``hf.EnergyCallback`` and ``lightning.EnergyCallback``
take either object, or any of its fields by name, and an unknown name is a ``TypeError`` naming the valid
ones, as Python's own is.

Plain values only: this module never imports torch or the OpenTelemetry SDK and never touches the network.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_energy_exporter.training.endpoint import DEFAULT_EXPORT_TIMEOUT, DEFAULT_FINISH_TIMEOUT
from gpu_energy_exporter.training.metadata import RunMetadata


@dataclass(frozen=True)
class ExportSettings:
    """Where a run's points go and what placement labels them. None: the default said here.

    - ``endpoint``: base URL of the receiver; default ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``, else
      ``OTEL_EXPORTER_OTLP_ENDPOINT``, else the exporter's Unix socket when it exists, else
      ``http://localhost:4318`` (with ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``: the same variables as a gRPC
      endpoint, else ``http://localhost:4317``); see ``endpoint.py``.
    - ``headers``: extra HTTP headers (e.g. ``{"Authorization": "Bearer ..."}``); default
      ``OTEL_EXPORTER_OTLP_HEADERS``.
    - ``export_interval``: seconds between background exports (default ``OTEL_METRIC_EXPORT_INTERVAL`` or
      10 s); ``export_timeout``: seconds one export may take; ``finish_timeout``: the bound on
      ``TrainingRun.finish()`` and ``flush()``.
    - ``gpu_uuids`` / ``device``: pin the GPUs this process uses (see ``gpus.py``); ``rank`` /
      ``world_size``: override what ``torch.distributed`` or ``RANK`` / ``WORLD_SIZE`` say (the callbacks
      take them from the trainer).
    - ``environ``: the environment to read the variables above from (default ``os.environ``).
    """

    endpoint: str | None = None
    headers: Mapping[str, str] | None = None
    export_interval: float | None = None
    export_timeout: float = DEFAULT_EXPORT_TIMEOUT
    finish_timeout: float = DEFAULT_FINISH_TIMEOUT
    gpu_uuids: Sequence[str] | None = None
    device: Any = None
    rank: int | None = None
    world_size: int | None = None
    environ: Mapping[str, str] | None = None

    def over(self, detected: ExportSettings) -> ExportSettings:
        """These settings (what the caller gave) with their None fields filled from ``detected`` (what a
        framework says: the device, rank and world size)."""
        return ExportSettings(**{f.name: getattr(detected, f.name) if getattr(self, f.name) is None
                                 else getattr(self, f.name) for f in dataclasses.fields(self)})


METADATA_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunMetadata))
EXPORT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ExportSettings))


def run_keywords(
    caller: Callable[..., Any],
    metadata: RunMetadata | None,
    export: ExportSettings | None,
    fields: Mapping[str, Any],
) -> tuple[RunMetadata, ExportSettings]:
    """``metadata`` and ``export`` (None: all defaults) with the ``fields`` given by name replacing theirs:
    ``start_run(model="x")`` is ``start_run(metadata=RunMetadata(model="x"))``. A name that is a field of
    neither is the ``TypeError`` Python raises for ``caller``, plus the names it takes."""
    unknown = [name for name in fields if name not in METADATA_FIELDS and name not in EXPORT_FIELDS]
    if unknown:
        raise TypeError(_unexpected(caller, unknown[0]))
    meta = {k: v for k, v in fields.items() if k in METADATA_FIELDS}
    settings = {k: v for k, v in fields.items() if k in EXPORT_FIELDS}
    return (dataclasses.replace(metadata or RunMetadata(), **meta),
            dataclasses.replace(export or ExportSettings(), **settings))


def _unexpected(caller: Callable[..., Any], name: str) -> str:
    named = [p.name for p in inspect.signature(caller).parameters.values()
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"]
    close = difflib.get_close_matches(name, [*METADATA_FIELDS, *EXPORT_FIELDS, *named], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{caller.__qualname__}() got an unexpected keyword argument {name!r}{hint}; it takes "
            f"{', '.join(named)}, the fields of RunMetadata ({', '.join(METADATA_FIELDS)}) and those of "
            f"ExportSettings ({', '.join(EXPORT_FIELDS)})")
