"""The collector registry (issue 32): a collector declares itself in its own module, and the command line,
the environment, the daemon's wiring, the start-up warnings and the generated docs all follow from that one
declaration."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_energy_exporter.collectors import registry
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.daemon.config import COLLECTORS, FLAGS, Config, load_config
from gpu_energy_exporter.devices.simulated import SimulatedBackend

ROOT = Path(__file__).resolve().parents[1]


def test_every_collector_module_is_discovered_and_builds_the_collector_it_names() -> None:
    names = [c.name for c in registry.specs()]
    assert names[0] == "gpu", "the gpu collector is built first: the others read its state"
    assert {"gpu", "gpm", "processes", "host", "rapl", "carbon", "kubernetes", "slurm", "health"} <= set(names)
    assert [c.name for c in COLLECTORS] == names
    config = load_config(["--collector.kubernetes", "--collector.slurm"], {})
    wiring = registry.Wiring(config, clock=lambda: 1000.0, read_counters_now=lambda: None,
                             backend_factory=lambda: SimulatedBackend(1))
    built = registry.build(wiring)
    try:
        assert [c.name for c in built] == [n for n in names if n in {c.name for c in built}]
        assert {c.name for c in built} == {c.name for c in registry.specs() if c.build and config.enabled(c.name)}
    finally:
        for c in built:
            c.close()


def test_a_collectors_flags_are_marked_as_its_own_and_parse_their_defaults() -> None:
    for spec in registry.specs():
        for flag in spec.flags:
            assert flag.collector == spec.name
            if flag.default is not None:
                flag.parse(flag.default)
    own = {f.name for s in registry.specs() for f in s.flags}
    assert {"collector.energy-interval", "collector.health.interval", "collector.slurm.job-mapping-dir",
            "kubernetes.api-url", "path.sysfs"} <= own
    assert own <= {f.name for f in FLAGS}, "every collector's flag is a flag of the daemon"


def test_a_collectors_check_refuses_a_bad_value_as_before() -> None:
    with pytest.raises(ConfigError, match="--collector.health.interval must be at least 1s"):
        load_config(["--collector.health.interval=500ms"], {})
    with pytest.raises(ConfigError, match="--collector.power-interval must be between 20ms"):
        load_config(["--collector.power-interval=2s"], {})


def test_a_collectors_flag_reads_as_an_attribute_of_the_config_given_or_not() -> None:
    assert Config().collector_energy_interval == 30.0  # the flag's default
    cfg = load_config(["--collector.energy-interval=45s"], {"GPU_ENERGY_EXPORTER_KUBERNETES_NODE_NAME": "n1"})
    assert cfg.collector_energy_interval == 45.0 and cfg.kubernetes_node_name == "n1"
    with pytest.raises(AttributeError, match="no_such_flag"):
        _ = cfg.no_such_flag


def test_a_collector_registered_from_one_module_is_on_the_cli_env_wiring_warnings_and_docs() -> None:
    # A collector as a third party would write it, registered before the daemon reads the registry: nothing
    # else in the package is told about it.
    script = textwrap.dedent('''
        import json, sys
        from prometheus_client.core import GaugeMetricFamily
        from gpu_energy_exporter.collectors.base import Collector
        from gpu_energy_exporter.collectors.registry import CollectorSpec, register
        from gpu_energy_exporter.core.flagtypes import Flag, positive_int

        class Answer(Collector):
            name = "answer"
            def __init__(self, value): self.value = value
            def update(self):
                fam = GaugeMetricFamily("gpuenergy_answer", "The answer.")
                fam.add_metric([], self.value)
                return [fam]

        register(CollectorSpec("answer", False, "The answer to everything.", order=99,
                               build=lambda w: Answer(w.config.answer_value),
                               flags=(Flag("answer.value", positive_int, "42", "What it answers.", "N"),)))

        from gpu_energy_exporter.daemon import config
        from gpu_energy_exporter.tools import docgen
        from gpu_energy_exporter.daemon.exporter import Exporter
        from gpu_energy_exporter.daemon.inertflags import inert_flags
        from gpu_energy_exporter.devices.simulated import SimulatedBackend

        help_text = config.new_parser().format_help()
        ns = config.new_parser().parse_args(["--answer.value=7"])
        off = config.config_from_namespace(ns, {})
        cfg = config.load_config(["--no-collector.gpu"], {"GPU_ENERGY_EXPORTER_COLLECTOR_ANSWER": "true",
                                                          "GPU_ENERGY_EXPORTER_ANSWER_VALUE": "6"})
        exp = Exporter(cfg)
        print(json.dumps({
            "help": "--collector.answer" in help_text and "--answer.value" in help_text
                    and "GPU_ENERGY_EXPORTER_ANSWER_VALUE" in help_text,
            "warning": inert_flags(ns, {}, off),
            "value": cfg.answer_value,
            "built": [c.name for c in exp.collectors],
            "sample": exp.collectors[[c.name for c in exp.collectors].index("answer")].update()[0].samples[0].value,
            "docs": "`--answer.value=N`" in docgen.configuration_markdown()
                    and "| `answer` | disabled |" in docgen.configuration_markdown(),
        }))
        exp.stop()
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["help"] is True
    assert got["warning"] == ["--answer.value has no effect: the answer collector is disabled (its default); "
                              "add --collector.answer to use it"]
    assert got["value"] == 6
    assert "answer" in got["built"] and "gpu" not in got["built"]
    assert got["sample"] == 6.0
    assert got["docs"] is True


def test_registering_a_second_collector_under_a_taken_name_is_refused() -> None:
    gpu = next(s for s in registry.specs() if s.name == "gpu")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.CollectorSpec("gpu", True, "impostor", build=lambda w: None))
    assert next(s for s in registry.specs() if s.name == "gpu") is gpu
