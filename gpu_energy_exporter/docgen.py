"""Generate the reference docs from the code: ``docs/metrics.md`` (the metric catalogue) and
``docs/configuration.md`` (flags, environment variables, collectors, carbon regions).

``python -m gpu_energy_exporter.docgen`` writes them; ``--check`` exits 1 if a committed file differs
(the test suite runs the check, so the docs cannot drift from the code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from gpu_energy_exporter.config import COLLECTORS, FLAGS
from gpu_energy_exporter.metrics import CATALOGUE

#: Every module that declares metrics; importing them fills the catalogue.
METRIC_MODULES = (
    "gpu_energy_exporter.sampler",
    "gpu_energy_exporter.collectors.gpu",
    "gpu_energy_exporter.collectors.host",
    "gpu_energy_exporter.collectors.rapl",
    "gpu_energy_exporter.collectors.carbon",
    "gpu_energy_exporter.collectors.kubernetes",
    "gpu_energy_exporter.otlp.store",
    "gpu_energy_exporter.ledger",
)

_COLLECTOR_TITLES = {
    "exporter": "Exporter self-metrics",
    "gpu": "GPUs (collector `gpu`, `gpm`, `processes`)",
    "host": "Host (collector `host`)",
    "rapl": "CPU and DRAM energy, RAPL (collector `rapl`)",
    "carbon": "Carbon and efficiency inputs (collector `carbon`)",
    "kubernetes": "Kubernetes pod attribution (collector `kubernetes`)",
    "otlp": "OTLP receiver self-metrics",
    "ledger": "Training runs, from the run ledger",
}


def load_catalogue() -> None:
    for module in METRIC_MODULES:
        importlib.import_module(module)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def metrics_markdown() -> str:
    load_catalogue()
    from gpu_energy_exporter.otlp.translate import metric_name
    from gpu_energy_exporter.training import instruments

    out = [
        "# Metric catalogue",
        "",
        "Generated from the code by `python -m gpu_energy_exporter.docgen`; do not edit by hand.",
        "",
        "Every per-GPU series carries `gpu` (the NVML index, which is not the `CUDA_VISIBLE_DEVICES` index) and",
        "`gpu_uuid` (stable, globally unique: the join key). Prometheus adds `instance` and `job` at scrape time.",
        "Also exposed: `gpuenergy_process_*` (the exporter's own CPU seconds, resident memory, open files) from",
        "prometheus_client's process collector.",
        "",
    ]
    by_collector: dict[str, list] = {}
    for spec in CATALOGUE.values():
        by_collector.setdefault(spec.collector, []).append(spec)
    order = list(_COLLECTOR_TITLES) + sorted(set(by_collector) - set(_COLLECTOR_TITLES))
    for collector in order:
        specs = by_collector.get(collector)
        if not specs:
            continue
        out += [f"## {_COLLECTOR_TITLES.get(collector, collector)}", "", "| metric | type | labels | description |",
                "|---|---|---|---|"]
        for spec in sorted(specs, key=lambda s: s.name):
            labels = ", ".join(f"`{label}`" for label in spec.labels) or "–"
            out.append(f"| `{spec.name}` | {spec.kind} | {labels} | {_escape(spec.help)} |")
        out.append("")
    out += [
        "## Training series (pushed by trainers over OTLP)",
        "",
        "Names as the OpenTelemetry → Prometheus compatibility rules give them, so they are the same whether",
        "they arrive through this exporter's receiver, an OpenTelemetry Collector or Prometheus's own OTLP",
        "receiver. Every series carries `run_id`, `rank` and `gpu_uuid` (comma-joined when a process uses",
        "several GPUs). See [training.md](training.md).",
        "",
        "| metric | OpenTelemetry instrument | kind | unit | description |",
        "|---|---|---|---|---|",
    ]
    for inst in instruments.ALL:
        prom = metric_name(inst.name, inst.unit, inst.kind)
        out.append(f"| `{prom}` | `{inst.name}` | {inst.kind} | `{inst.unit or '–'}` | "
                   f"{_escape(inst.description)} |")
    out.append("")
    return "\n".join(out)


def configuration_markdown() -> str:
    from gpu_energy_exporter import carbon

    out = [
        "# Configuration reference",
        "",
        "Generated from the code by `python -m gpu_energy_exporter.docgen`; do not edit by hand.",
        "",
        "Every flag can also be set through the environment variable shown (a flag on the command line wins).",
        "Durations take Prometheus's form (`100ms`, `1s`, `5m`, `1h30m`); a bare number such as `5` is refused",
        "(write `5s`), except `0`. Addresses are `host:port`, `:port` (all interfaces) or `[ipv6]:port`. Flags",
        "are never abbreviated (`--web.listen` is an error, not `--web.listen-address`). An invalid value stops",
        "the exporter before it starts, with one line naming the flag or variable and what is accepted.",
        "",
        "## Flags",
        "",
        "| flag | environment variable | default | description |",
        "|---|---|---|---|",
    ]
    for f in FLAGS:
        default = f"`{f.default}`" if f.default is not None else "unset"
        out.append(f"| `--{f.name}={f.metavar}` | `{f.env}` | {default} | {_escape(f.help)} |")
    out += [
        "",
        "## Collectors",
        "",
        "`--collector.<name>` enables a collector, `--no-collector.<name>` disables it; the environment",
        "variable takes `true`/`false`.",
        "",
        "| collector | default | environment variable | what it collects |",
        "|---|---|---|---|",
    ]
    for c in COLLECTORS:
        out.append(f"| `{c.name}` | {'enabled' if c.default else 'disabled'} | `{c.env}` | {_escape(c.help)} |")
    out += [
        "",
        "## Sub-commands",
        "",
        "`gpu-energy-exporter runs`, `top`, `report` and `demo`: see `gpu-energy-exporter <command> --help`,",
        "[ledger.md](ledger.md) and [workstation.md](workstation.md).",
        "",
        "## Carbon intensity regions (`--carbon.region`)",
        "",
        f"Without a region, flag or file the exporter uses the world average, {carbon.WORLD_DEFAULT_G_PER_KWH:g} "
        f"gCO2e/kWh ({carbon.WORLD_DEFAULT_YEAR}), labelled `source=\"default\"`. Sources and licences of the "
        "tables: `gpu_energy_exporter/data/SOURCES.md`.",
        "",
        "| code | region | gCO2e/kWh | year |",
        "|---|---|---|---|",
    ]
    for table in (carbon.country_table(), carbon.cloud_table()):
        for code in sorted(table):
            row = table[code]
            out.append(f"| `{row.code}` | {_escape(row.name)} | {row.grams_per_kwh:g} | {row.year} |")
    out.append("")
    return "\n".join(out)


DOCS = {"metrics.md": metrics_markdown, "configuration.md": configuration_markdown}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_energy_exporter.docgen", description=__doc__)
    parser.add_argument("--docs", default=str(Path(__file__).resolve().parent.parent / "docs"))
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name, render in DOCS.items():
        path = Path(args.docs) / name
        text = render()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date: " + ", ".join(stale) + " (run: python -m gpu_energy_exporter.docgen)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
