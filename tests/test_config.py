"""Flags, environment variables and their validation (config.load_config and the CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.daemon.config import (
    COLLECTORS,
    DEFAULT_METRICS_PORT,
    FLAGS,
    load_config,
    parse_duration,
    parse_listen_address,
)


def test_defaults_are_valid_and_documented_port_is_unused_by_well_known_exporters() -> None:
    cfg = load_config([], {})
    assert cfg.web_listen_address == ("", DEFAULT_METRICS_PORT)
    assert DEFAULT_METRICS_PORT not in (9100, 9400, 9835, 9445)
    assert cfg.otlp_listen_address == ("localhost", 4318)
    assert cfg.collector_interval == 1.0 and cfg.collector_power_interval == 0.1
    assert cfg.enabled("gpu") and cfg.enabled("host") and not cfg.enabled("processes")


@pytest.mark.parametrize(
    ("raw", "seconds"), [("100ms", 0.1), ("1s", 1.0), ("5m", 300.0), ("1h30m", 5400.0), ("0", 0.0), ("1.5s", 1.5)]
)
def test_durations(raw: str, seconds: float) -> None:
    assert parse_duration(raw) == pytest.approx(seconds)


@pytest.mark.parametrize("raw", ["", "abc", "5 minutes", "-1s", "1x", "s", "5", "0.5"])
def test_bad_durations(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(raw)


@pytest.mark.parametrize(
    ("raw", "addr"), [(":9863", ("", 9863)), ("0.0.0.0:1", ("0.0.0.0", 1)), ("[::1]:80", ("::1", 80)),
                      ("localhost:4318", ("localhost", 4318))],
)
def test_listen_addresses(raw: str, addr: tuple[str, int]) -> None:
    assert parse_listen_address(raw) == addr


@pytest.mark.parametrize("raw", ["9863", "host", "host:99999", "a:b:c"])
def test_bad_listen_addresses(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_listen_address(raw)


def test_every_flag_also_from_environment_and_flag_wins() -> None:
    env = {"GPU_ENERGY_EXPORTER_COLLECTOR_INTERVAL": "2s", "GPU_ENERGY_EXPORTER_CARBON_PUE": "1.3",
           "GPU_ENERGY_EXPORTER_COLLECTOR_RAPL": "false", "GPU_ENERGY_EXPORTER_COLLECTOR_PROCESSES": "1"}
    cfg = load_config([], env)
    assert cfg.collector_interval == 2.0 and cfg.carbon_pue == 1.3
    assert not cfg.enabled("rapl") and cfg.enabled("processes")
    cfg = load_config(["--collector.interval=3s", "--collector.rapl"], env)
    assert cfg.collector_interval == 3.0 and cfg.enabled("rapl")
    # every flag has a distinct environment variable
    names = [f.env for f in FLAGS] + [c.env for c in COLLECTORS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--collector.interval=soon"], {}, "--collector.interval"),
        (["--collector.power-interval=5ms"], {}, "20ms"),
        (["--collector.power-interval=2s"], {}, "--collector.power-interval"),
        (["--carbon.pue=0.8"], {}, "--carbon.pue"),
        (["--web.listen-address=9863"], {}, "--web.listen-address"),
        (["--web.config.file=/nonexistent.yml"], {}, "does not exist"),
        (["--nope"], {}, "unrecognized arguments"),
        ([], {"GPU_ENERGY_EXPORTER_OTLP_MAX_SERIES": "-5"}, "GPU_ENERGY_EXPORTER_OTLP_MAX_SERIES"),
        ([], {"GPU_ENERGY_EXPORTER_COLLECTOR_GPU": "maybe"}, "GPU_ENERGY_EXPORTER_COLLECTOR_GPU"),
        (["--web.listen-address=:4318", "--otlp.listen-address=:4318"], {}, "must differ"),
    ],
)
def test_invalid_values_are_one_clear_error(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(argv, env)
    assert message in str(exc.value)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpu_energy_exporter", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_help_lists_flags_env_and_subcommands() -> None:
    out = _cli("--help")
    assert out.returncode == 0
    for needle in ("--web.listen-address", "--no-collector.gpu", "GPU_ENERGY_EXPORTER_WEB_LISTEN_ADDRESS",
                   "(default: :9863)", "runs", "demo"):
        assert needle in out.stdout


def test_cli_bad_flag_exits_2_with_one_line_before_starting() -> None:
    out = _cli("--collector.interval=fast")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid value 'fast' for --collector.interval" in lines[0]


def test_energy_timestamps_switch_is_off_by_default_and_settable_both_ways() -> None:
    env = "GPU_ENERGY_EXPORTER_COLLECTOR_GPU_ENERGY_TIMESTAMPS"
    assert load_config([], {}).collector_gpu_energy_timestamps is False
    assert load_config(["--collector.gpu.energy-timestamps"], {}).collector_gpu_energy_timestamps is True
    assert load_config([], {env: "true"}).collector_gpu_energy_timestamps is True
    # the command line wins over the environment, in both directions
    assert load_config(["--no-collector.gpu.energy-timestamps"], {env: "yes"}).collector_gpu_energy_timestamps is False
    assert load_config(["--collector.gpu.energy-timestamps"], {env: "0"}).collector_gpu_energy_timestamps is True
    with pytest.raises(ConfigError, match=env):
        load_config([], {env: "sometimes"})
