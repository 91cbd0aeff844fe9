"""Carbon inputs: the bundled tables, start-up resolution, the intensity file, and per-GPU peak FLOP/s."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import registry_of
from prometheus_client import CollectorRegistry, generate_latest

from gpu_energy_exporter.collectors.carbon import CarbonCollector
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.state import ENERGY_METHOD_COUNTER, GPUIdentity
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.reference import carbon
from gpu_energy_exporter.reference.carbon import (
    WORLD_DEFAULT_G_PER_KWH,
    IntensityResolution,
    lookup_region,
    parse_intensity_text,
    resolve_intensity,
)
from gpu_energy_exporter.reference.gpu_specs import PRECISIONS, lookup_peak_flops, parse_peak_table, peak_table

DATA = Path(carbon.__file__).parent / "data"
LOGGER = "gpu_energy_exporter.collectors.carbon"
INTENSITY = "gpuenergy_carbon_intensity_grams_per_kilowatt_hour"


def intensity_of(reg: CollectorRegistry) -> tuple[float, dict[str, str]]:
    samples = [s for m in reg.collect() for s in m.samples if s.name == INTENSITY]
    assert len(samples) == 1
    return samples[0].value, dict(samples[0].labels)


def gpu(index: int, name: str) -> GPUIdentity:
    return GPUIdentity(
        index=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000", name=name,
        pci_bus_id=f"00000000:{index + 0x17:02X}:00.0", architecture="unknown", compute_capability="",
        energy_method=ENERGY_METHOD_COUNTER, power_usage_is_average=True,
    )


def write_intensity(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    # Explicit, distinct mtimes: coarse filesystem timestamps must not hide a change from the test.
    os.utime(path, ns=(mtime_ns, mtime_ns))


# -- the bundled tables ---------------------------------------------------------------------------------


def test_country_table_matches_the_bundled_csv() -> None:
    with open(DATA / "grid-carbon-intensity-by-country.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    table = carbon.country_table()
    assert len(table) == len(rows) > 200
    for row in rows:
        entry = table[row["iso3"]]
        assert entry.grams_per_kwh == float(row["grams_co2e_per_kwh"])
        assert entry.year == row["year"]
        assert "CC BY 4.0" in entry.reference


@pytest.mark.parametrize("code", ["FRA", "fra", " Fra "])
def test_country_lookup_is_case_insensitive(code: str) -> None:
    row = lookup_region(code)
    assert (row.code, row.name, row.grams_per_kwh, row.year) == ("FRA", "France", 56.039, "2023")


@pytest.mark.parametrize("code", ["gcp:europe-west1", "GCP:Europe-West1"])
def test_cloud_lookup(code: str) -> None:
    row = lookup_region(code)
    assert row.code == "gcp:europe-west1"
    assert row.grams_per_kwh == 122.0
    assert row.year == "unknown"
    assert row.reference.startswith("https://cloud.google.com/")
    assert "Belgium" in row.name


def test_cloud_region_typo_of_the_source_is_fixed() -> None:
    assert lookup_region("gcp:me-central1").grams_per_kwh == 575.0
    with pytest.raises(ConfigError):
        lookup_region("gcp:me-cenrtal1")


def test_every_code_resolves() -> None:
    codes = carbon.region_codes()
    assert "USA" in codes and "gcp:us-central1" in codes
    for code in codes:
        assert lookup_region(code).grams_per_kwh >= 0


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("XYZ", "alpha-3"),
        ("FR", "not alpha-2"),
        ("aws:us-east-1", "gcp only"),
        ("gcp:europe-west99", "unknown --carbon.region"),
        ("gcp:europe-wset1", "did you mean gcp:europe-west1"),
        ("", "unknown --carbon.region"),
    ],
)
def test_unknown_region_is_a_config_error_saying_where_to_look(code: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        lookup_region(code)
    assert says in str(err.value)
    assert "docs/configuration.md" in str(err.value)


@pytest.mark.parametrize(("text", "value"), [("412", 412.0), (" 56.5\n", 56.5), ("0", 0.0), ("1e2", 100.0)])
def test_intensity_text(text: str, value: float) -> None:
    assert parse_intensity_text(text) == value


@pytest.mark.parametrize("text", ["", "  \n", "abc", "-3", "nan", "inf", "412 g/kWh", "1\n2"])
def test_bad_intensity_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_intensity_text(text)


# -- start-up resolution --------------------------------------------------------------------------------


def test_default_is_the_stated_world_average() -> None:
    res = resolve_intensity(load_config([], {}))
    assert res == IntensityResolution(480.0, "default", "world", "2023")
    assert WORLD_DEFAULT_G_PER_KWH == 480.0
    assert "Ember" in carbon.reference_for(res)


def test_region_from_the_table() -> None:
    assert resolve_intensity(load_config(["--carbon.region=deu"], {})) == IntensityResolution(
        380.95, "table", "DEU", "2023")


def test_region_from_the_environment() -> None:
    cfg = load_config([], {"GPU_ENERGY_EXPORTER_CARBON_REGION": "gcp:europe-north1"})
    assert resolve_intensity(cfg) == IntensityResolution(46.0, "table", "gcp:europe-north1", "unknown")


def test_flag_overrides_region_but_region_still_labels() -> None:
    cfg = load_config(["--carbon.region=FRA", "--carbon.intensity=33.5"], {})
    assert resolve_intensity(cfg) == IntensityResolution(33.5, "flag", "FRA", "")


def test_bad_region_fails_even_when_overridden() -> None:
    cfg = load_config(["--carbon.region=Frankreich", "--carbon.intensity=33.5"], {})
    with pytest.raises(ConfigError, match="Frankreich"):
        resolve_intensity(cfg)


def test_file_wins_over_flag_and_region(tmp_path: Path) -> None:
    f = tmp_path / "intensity"
    f.write_text("250\n")
    cfg = load_config([f"--carbon.intensity-file={f}", "--carbon.intensity=33.5", "--carbon.region=FRA"], {})
    assert resolve_intensity(cfg) == IntensityResolution(250.0, "file", "FRA", "")


def test_bad_file_content_fails_at_start_up(tmp_path: Path) -> None:
    f = tmp_path / "intensity"
    f.write_text("very green\n")
    with pytest.raises(ConfigError, match="one number"):
        resolve_intensity(load_config([f"--carbon.intensity-file={f}"], {}))


def test_unreadable_file_fails_at_start_up(tmp_path: Path) -> None:
    f = tmp_path / "intensity"
    f.write_text("1")
    cfg = load_config([f"--carbon.intensity-file={f}"], {})
    f.unlink()
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_intensity(cfg)


# -- the collector --------------------------------------------------------------------------------------


def test_gauges_from_a_region() -> None:
    c = CarbonCollector.from_config(load_config(["--carbon.region=FRA", "--carbon.pue=1.2"], {}))
    reg = registry_of(c.update())
    assert intensity_of(reg) == (56.039, {"source": "table", "region": "FRA"})
    assert reg.get_sample_value("gpuenergy_datacenter_pue") == 1.2
    assert reg.get_sample_value("gpuenergy_carbon_info", {
        "source": "table", "region": "FRA", "year": "2023",
        "reference": "Our World in Data, based on Ember and the Energy Institute (CC BY 4.0)"}) == 1


def test_default_is_labelled_as_such() -> None:
    reg = registry_of(CarbonCollector.from_config(load_config([], {})).update())
    assert intensity_of(reg) == (480.0, {"source": "default", "region": "world"})
    info = [s for m in reg.collect() for s in m.samples if s.name == "gpuenergy_carbon_info"]
    assert info[0].labels["year"] == "2023" and "Ember" in info[0].labels["reference"]
    assert reg.get_sample_value("gpuenergy_datacenter_pue") == 1.0


def test_intensity_file_is_re_read_when_it_changes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "intensity"
    write_intensity(f, "100\n", 1_000_000_000_000_000_000)
    c = CarbonCollector.from_config(load_config([f"--carbon.intensity-file={f}"], {}))
    assert intensity_of(registry_of(c.update())) == (100.0, {"source": "file", "region": ""})

    write_intensity(f, "200\n", 1_000_000_001_000_000_000)
    assert intensity_of(registry_of(c.update()))[0] == 200.0

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        write_intensity(f, "oops\n", 1_000_000_002_000_000_000)
        assert intensity_of(registry_of(c.update()))[0] == 200.0  # last good value kept
        assert intensity_of(registry_of(c.update()))[0] == 200.0
    assert len([r for r in caplog.records if "keeping the last good value" in r.getMessage()]) == 1

    write_intensity(f, "300\n", 1_000_000_003_000_000_000)
    assert intensity_of(registry_of(c.update()))[0] == 300.0


def test_atomic_replace_with_same_mtime_and_size_is_seen(tmp_path: Path) -> None:
    f = tmp_path / "intensity"
    write_intensity(f, "111\n", 1_000_000_000_000_000_000)
    c = CarbonCollector.from_config(load_config([f"--carbon.intensity-file={f}"], {}))
    c.update()
    new = tmp_path / "intensity.new"
    write_intensity(new, "222\n", 1_000_000_000_000_000_000)
    os.replace(new, f)
    assert intensity_of(registry_of(c.update()))[0] == 222.0


def test_vanished_file_keeps_the_value_and_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "intensity"
    write_intensity(f, "150\n", 1_000_000_000_000_000_000)
    c = CarbonCollector.from_config(load_config([f"--carbon.intensity-file={f}"], {}))
    c.update()
    f.unlink()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            assert intensity_of(registry_of(c.update()))[0] == 150.0
    assert len([r for r in caplog.records if "is gone" in r.getMessage()]) == 1


def test_file_source_without_a_path_is_refused() -> None:
    with pytest.raises(ValueError):
        CarbonCollector(intensity=IntensityResolution(1.0, "file", "", ""))


def test_peak_flops_per_gpu_and_precision(caplog: pytest.LogCaptureFixture) -> None:
    gpus = [gpu(0, "NVIDIA H100 80GB HBM3"), gpu(1, "Tesla V100-SXM2-16GB"), gpu(2, "NVIDIA Imaginary X1"),
            gpu(3, "NVIDIA A10G")]
    c = CarbonCollector.from_config(load_config([], {}), gpus=lambda: gpus)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        c.update()
        reg = registry_of(c.update())
    h100 = {"gpu": "0", "gpu_uuid": gpus[0].uuid}
    name = "gpuenergy_gpu_peak_flops_per_second"
    assert reg.get_sample_value(name, {**h100, "precision": "bf16"}) == 989.5e12
    assert reg.get_sample_value(name, {**h100, "precision": "fp8"}) == 1979e12
    assert reg.get_sample_value(name, {**h100, "precision": "tf32"}) == 494.5e12
    v100 = {"gpu": "1", "gpu_uuid": gpus[1].uuid}
    assert reg.get_sample_value(name, {**v100, "precision": "fp16"}) == 125e12
    assert reg.get_sample_value(name, {**v100, "precision": "bf16"}) is None  # Volta has no BF16
    per_gpu = {s.labels["gpu"] for m in reg.collect() for s in m.samples if s.name == name}
    assert per_gpu == {"0", "1"}
    unknown = [r for r in caplog.records if "MFU is not available" in r.getMessage()]
    assert len(unknown) == 2  # the unknown model and the A10G, once each over two updates


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus package) not installed")
def test_exposition_passes_promtool_lint() -> None:
    c = CarbonCollector.from_config(load_config(["--carbon.region=gcp:us-west1"], {}),
                                    gpus=lambda: [gpu(0, "NVIDIA A100-SXM4-80GB")])
    text = generate_latest(registry_of(c.update()))
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


# -- the peak FLOP/s table ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nvml_name", "model", "bf16"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5", 989.5e12),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", "NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", "NVIDIA H200 SXM", 989.5e12),
        ("NVIDIA H200 NVL", "NVIDIA H200 NVL", 835.5e12),
        ("NVIDIA GH200 480GB", "NVIDIA GH200 (Hopper GPU)", 989.5e12),
        ("NVIDIA B200", "NVIDIA B200 (HGX)", 2.25e15),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM4 40GB/80GB", 312e12),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 SXM4 40GB/80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 PCIe 40GB/80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 PCIe 40GB/80GB", 312e12),
        ("A100-SXM4-40GB", "NVIDIA A100 SXM4 40GB/80GB", 312e12),  # older drivers: no "NVIDIA " prefix
        ("NVIDIA L40S", "NVIDIA L40S", 362.05e12),
        ("NVIDIA L4", "NVIDIA L4", 121e12),
        ("NVIDIA A10", "NVIDIA A10", 125e12),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", 165.2e12),
        ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090", 71e12),
        ("NVIDIA RTX A6000", "NVIDIA RTX A6000", 154.8e12),
        ("NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX 6000 Ada Generation", 364.2e12),
        ("Tesla V100-SXM2-32GB", "Tesla V100 SXM2", None),
        ("Tesla V100-PCIE-16GB", "Tesla V100 PCIe", None),
        ("Tesla V100S-PCIE-32GB", "Tesla V100S PCIe", None),
        ("Tesla T4", "Tesla T4", None),
        ("NVIDIA A10G", "NVIDIA A10G", None),
    ],
)
def test_nvml_names_match_the_right_row(nvml_name: str, model: str, bf16: float | None) -> None:
    row = lookup_peak_flops(nvml_name)
    assert row is not None and row.model == model
    assert row.flops.get("bf16") == bf16


@pytest.mark.parametrize(
    "nvml_name",
    ["NVIDIA L40", "NVIDIA GB200", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4090 D",
     "NVIDIA GeForce RTX 4090 Laptop GPU", "Quadro RTX 6000", "NVIDIA A100X", "Tesla P100-PCIE-16GB"],
)
def test_lookalike_models_do_not_borrow_a_figure(nvml_name: str) -> None:
    assert lookup_peak_flops(nvml_name) is None


def test_bundled_table_is_consistent() -> None:
    rows = peak_table()
    assert len(rows) >= 20
    for row in rows:
        assert set(row.flops) <= set(PRECISIONS)
        if row.flops:
            assert row.source and row.year.isdigit(), row.model
        if row.sparsity_halved:
            assert "sparsity" in row.source
        # Tensor math gets faster (or equal) as precision drops: fp8 >= fp16 == bf16 >= tf32.
        f = row.flops
        if "fp16" in f and "bf16" in f:
            assert f["fp16"] == f["bf16"], row.model
        if "fp8" in f:
            assert f["fp8"] >= f["fp16"], row.model
        if "tf32" in f:
            assert f["tf32"] <= f["fp16"], row.model


HEADER = "model,pattern,bf16,fp16,fp8,tf32,sparsity_halved,source,year,note\n"


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("X,\\bX(,,,,,no,doc,2020,\n", "bad pattern"),
        ("X,\\bX\\b,989,,,,no,doc,2020,\n", "not a FLOP/s figure"),
        ("X,\\bX\\b,,abc,,,no,doc,2020,\n", "line 2 .X.: fp16 'abc' is not a number"),
        ("X,\\bX\\b,,,,,maybe,doc,2020,\n", "sparsity_halved"),
    ],
)
def test_bad_peak_table_rows_are_rejected(line: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_peak_table(HEADER + line)


def test_peak_table_missing_column() -> None:
    with pytest.raises(ValueError, match="fp8"):
        parse_peak_table("model,pattern,bf16,fp16,tf32,sparsity_halved,source,year\n")


def test_custom_table_first_match_wins() -> None:
    table = parse_peak_table(HEADER + "Special,\\bH100 SPECIAL\\b,1e15,,,,no,doc,2024,\n"
                             "Generic,\\bH100\\b,2e15,,,,no,doc,2024,\n")
    assert lookup_peak_flops("NVIDIA H100 special edition", table).model == "Special"  # type: ignore[union-attr]
    assert lookup_peak_flops("NVIDIA H100", table).model == "Generic"  # type: ignore[union-attr]
