"""Issue 31, "the edges a new user still hits": the no-GPU hint (item 1), ``report`` given a path that does
not exist or an unknown run (item 4), flags of a disabled collector (item 6), "did you mean" for a
misspelled flag (item 7) and the test set-up's package list (item 8). The wrong port or scheme (items 2,
3) is tests/test_client_ports.py; the stale ``top`` frame (item 5) tests/test_top.py; the report's value
labels (item 9) tests/test_report.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakenvml import Driver, Scenario, h100
from helpers import ROOT, ExporterProcess, wait_until

from gpu_energy_exporter.client import report
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.daemon.cli import NO_GPU_HINT
from gpu_energy_exporter.daemon.config import (
    COLLECTORS,
    FLAGS,
    config_from_namespace,
    load_config,
    new_parser,
)
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.daemon.inertflags import inert_flags
from gpu_energy_exporter.devices.simulated import SimulatedBackend


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpu_energy_exporter", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# -- item 1: no GPU driver: say how to try it -------------------------------------------------------------


def test_without_a_driver_the_exporter_says_how_to_try_it_with_the_demo(
        start_exporter: type[ExporterProcess], fake_nvml_lib: Path) -> None:
    # the fake library without a scenario answers nvmlInit with NVML_ERROR_DRIVER_NOT_LOADED, as a machine
    # with the library but no driver does (and whatever GPU the machine running the suite has)
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}"], {}).wait_ready()
    wait_until(lambda: "gpu-energy-exporter demo" in exp.log(), what="the demo hint")
    hints = [line for line in exp.lines if "gpu-energy-exporter demo" in line]
    assert len(hints) == 1 and "level=warn" in hints[0], hints
    assert "make run ARGS=demo" in hints[0] and "no NVIDIA driver here" in hints[0]
    nvml = next(i for i, line in enumerate(exp.lines) if "NVML unavailable" in line)
    assert exp.lines.index(hints[0]) > nvml, "the hint follows NVML's own warning"
    assert exp.stop() == 0


def test_a_driver_that_refuses_permission_gets_no_demo_hint(
        start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.ini"
    Scenario(epoch=time.time(), driver=Driver(init_error=4), gpus=[h100(0)]).write(scenario)  # NO_PERMISSION
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}"], {"FAKE_NVML_SCENARIO": str(scenario)}).wait_ready()
    wait_until(lambda: "NVML unavailable" in exp.log(), what="the NVML warning")
    assert exp.stop() == 0
    assert "no permission" in exp.log() and NO_GPU_HINT not in exp.log()


# -- item 4: report given a path that does not exist, or an unknown run -----------------------------------


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                          "--otlp.grpc.listen-address=", "--no-collector.rapl"], {})
    exp = Exporter(config, backend_factory=lambda: SimulatedBackend(1))
    exp.start()
    try:
        yield exp
    finally:
        exp.stop()


def _report(args: list[str], cwd: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        rc = report.main(args, stdout=out, stderr=err)
    finally:
        os.chdir(before)
    return rc, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("item", ["runs/nope.json", "./nope", "nope.JSON", "runs/nope"])
def test_report_of_a_path_that_does_not_exist_says_no_such_file(exporter: Exporter, tmp_path: Path,
                                                                 item: str) -> None:
    # "report runs/nope.json" was taken for a run id: "unknown run 'runs/nope.json'"
    (tmp_path / "runs").mkdir()
    assert exporter.web is not None
    rc, text = _report([item, "--url", exporter.web.url, "--out", str(tmp_path / "out")], tmp_path)
    assert rc == 2
    assert f"no such file {item!r}" in text and "unknown run" not in text, text
    assert "gpu-energy-exporter runs" in text
    assert not (tmp_path / "out").exists()


def test_report_of_an_unknown_run_points_to_runs(exporter: Exporter, tmp_path: Path) -> None:
    assert exporter.web is not None
    url = exporter.web.url
    for item in ("no-such-run", "team/run-7"):  # a slash into no directory is still a run id
        rc, text = _report([item, "--url", url, "--out", str(tmp_path / "out")], tmp_path)
        assert rc == 2
        assert f"unknown run {item!r} at {url}" in text, text
        assert f"`gpu-energy-exporter runs --url {url}` lists the runs it knows" in text, text
        assert "JSON summary" in text and "/api/v1/runs" not in text


def test_report_reads_an_existing_summary_by_any_path_form(tmp_path: Path) -> None:
    from test_first_hour_clients import _document

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r.json").write_text(json.dumps(_document()), encoding="utf-8")
    for item in ("runs/r.json", "./runs/r.json", str(tmp_path / "runs" / "r.json")):
        rc, text = _report([item, "--out", str(tmp_path / "out")], tmp_path)
        assert rc == 0, text
        assert "two-gpus:" in text


# -- item 6: flags of a disabled collector -----------------------------------------------------------------


def _inert(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    env = env or {}
    ns = new_parser().parse_args(argv)
    return inert_flags(ns, env, config_from_namespace(ns, env))


@pytest.mark.parametrize(("argv", "env", "expected"), [
    # a user coming from dcgm-exporter passes the directory alone
    (["--collector.slurm.job-mapping-dir=/srv/jobs"], {},
     ["--collector.slurm.job-mapping-dir has no effect: the slurm collector is disabled (its default); add "
      "--collector.slurm to use it"]),
    (["--collector.slurm", "--collector.slurm.job-mapping-dir=/srv/jobs"], {}, []),
    (["--no-collector.gpu", "--gpu.idle-power=60", "--collector.gpu.process-interval=5s"], {},
     ["--gpu.idle-power, --collector.gpu.process-interval have no effect: the gpu collector is disabled "
      "(--no-collector.gpu); remove --no-collector.gpu to use them"]),
    ([], {"GPU_ENERGY_EXPORTER_KUBERNETES_REFRESH_INTERVAL": "5s"},
     ["GPU_ENERGY_EXPORTER_KUBERNETES_REFRESH_INTERVAL has no effect: the kubernetes collector is disabled (its "
      "default); add --collector.kubernetes to use it"]),
    (["--collector.health.interval=10s"], {"GPU_ENERGY_EXPORTER_COLLECTOR_HEALTH": "false"},
     ["--collector.health.interval has no effect: the health collector is disabled "
      "(GPU_ENERGY_EXPORTER_COLLECTOR_HEALTH=false); set GPU_ENERGY_EXPORTER_COLLECTOR_HEALTH=true or pass "
      "--collector.health to use it"]),
    # the ledger prices CO2 with the carbon flags whatever the carbon collector: no warning
    (["--no-collector.carbon", "--carbon.pue=1.2"], {}, []),
    # defaults are not "given"
    (["--no-collector.rapl", "--no-collector.host", "--no-collector.gpu"], {}, []),
])
def test_flags_of_a_disabled_collector_are_named_with_the_flag_to_add(
        argv: list[str], env: dict[str, str], expected: list[str]) -> None:
    assert _inert(argv, env) == expected


def test_every_sub_flag_of_a_collector_names_its_collector() -> None:
    # the rule is the flag table's: a flag under --collector.<name>. (node_exporter's naming) belongs to
    # that collector, and so does every flag that names one
    names = {c.name for c in COLLECTORS}
    for flag in FLAGS:
        assert flag.collector in names | {""}, flag.name
        parts = flag.name.split(".")
        if parts[0] == "collector" and len(parts) > 2:
            assert flag.collector == parts[1], flag.name
    # one rule for every collector: all its flags given while it is off make one warning naming them all
    owned = {c.name: [f for f in FLAGS if f.collector == c.name] for c in COLLECTORS}
    assert {name for name, flags in owned.items() if flags} >= {"gpu", "gpm", "health", "slurm", "kubernetes"}
    for name, flags in owned.items():
        if not flags:
            continue
        ns = new_parser().parse_args([f"--no-collector.{name}"])
        config = config_from_namespace(ns, {})
        for f in flags:
            setattr(ns, f.dest, True if f.boolean else "given")
        warnings = inert_flags(ns, {}, config)
        assert len(warnings) == 1 and f"remove --no-collector.{name}" in warnings[0], warnings
        assert all(f"--{f.name}" in warnings[0] for f in flags), warnings


def test_the_exporter_warns_at_start_about_a_flag_without_effect(start_exporter: type[ExporterProcess],
                                                                  tmp_path: Path) -> None:
    exp = start_exporter(["--no-collector.gpu", f"--collector.slurm.job-mapping-dir={tmp_path}"], {}).wait_ready()
    assert exp.stop() == 0
    lines = [line for line in exp.lines if "has no effect" in line]
    assert len(lines) == 1 and "level=warn" in lines[0], exp.log()
    assert "--collector.slurm.job-mapping-dir has no effect" in lines[0] and "add --collector.slurm" in lines[0]


# -- item 7: did you mean ----------------------------------------------------------------------------------


def test_a_misspelled_flag_gets_the_closest_one() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["--web.listen-adress=:9"], {})
    assert str(info.value) == ("unrecognized arguments: --web.listen-adress=:9; did you mean "
                               "--web.listen-address? (see --help)")
    with pytest.raises(ConfigError) as info:
        load_config(["--no-colector.gpu", "--collector.intreval=1s"], {})
    assert "did you mean --no-collector.gpu (for --no-colector.gpu), --collector.interval (for " \
           "--collector.intreval)?" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(["--zzz-totally-unknown"], {})
    assert "did you mean" not in str(info.value)


def test_the_cli_and_its_sub_commands_suggest_the_flag() -> None:
    out = _cli("--web.listen-adress=:9863")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you mean --web.listen-address?" in lines[0], out.stderr
    typos = (("demo", "--demo.gpu=2", "--demo.gpus"), ("top", "--intervall=1s", "--interval"),
             ("runs", "--group-bye=backend", "--group-by"), ("report", "--promethus=x", "--prometheus"))
    for sub, typo, right in typos:
        out = _cli(sub, typo, *(["run-1"] if sub == "report" else []))
        assert out.returncode == 2 and f"unrecognized arguments: {typo}; did you mean {right}?" in out.stderr, \
            out.stderr


# -- item 8: the test set-up's package list ----------------------------------------------------------------


def test_setup_test_env_lists_each_missing_package_once(tmp_path: Path) -> None:
    # "prometheus prometheus": promtool and prometheus both come from Debian's prometheus
    empty = tmp_path / "bin"
    empty.mkdir()
    out = subprocess.run(["/bin/bash", str(ROOT / ".ci" / "setup-test-env"), "--missing"], capture_output=True,
                         text=True, timeout=60, env={"PATH": str(empty), "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    packages = out.stdout.split()
    assert packages.count("prometheus") == 1, packages
    assert len(packages) == len(set(packages)), packages
    assert {"tmux", "gcc", "buildah", "debootstrap", "faketime"} <= set(packages)
