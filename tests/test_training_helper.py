"""The plain training API (``gpu_energy_exporter.training``) pushing to the exporter's real OTLP receiver.

What reaches the receiver is read back from its store exactly as ``/metrics`` would expose it. GPU
resolution runs both on pure data (``NVMLGPU`` lists) and through the real ``pynvml`` against the
project's fake ``libnvidia-ml.so.1`` in a child process (pynvml keeps process-wide state).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap
import time
import timeit
from pathlib import Path

import pytest
from fakenvml import Scenario, build_library, h100, mig_uuids, v100
from training_models import closed_port, label_values, receiver, series, total

from gpu_energy_exporter.otlp.receiver import OTLPReceiver
from gpu_energy_exporter.otlp.store import TrainingStore
from gpu_energy_exporter.training import count_batch, resolve_endpoint, start_run
from gpu_energy_exporter.training.gpus import (
    NVMLGPU,
    NVMLMissing,
    _from_torch,
    map_visible_devices,
    parse_visible_devices,
    resolve_gpus,
)

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
LOGGER = "gpu_energy_exporter.training"
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "OTEL_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)])
    env.update(extra)
    return env


def run_child(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=child_env(**env), timeout=60, check=False)


# ----------------------------------------------------------------------------------------------------
# what reaches the receiver


def test_totals_attributes_and_metadata_reach_the_receiver() -> None:
    with receiver() as (endpoint, store):
        run = start_run(
            "run-a", model="tiny-lm", backend="bnb", optimizer="adamw", batch_size=4, grad_accum=2,
            seq_len=16, precision="bf16", seed=7, notes="lora r=8", total_steps=5, parameters=8_030_261_248,
            endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A, GPU_B],
            environ={"RANK": "1", "WORLD_SIZE": "2"},
        )
        for i in range(5):
            run.step(tokens=64, samples=4, loss=2.0 - i / 10, lr=1e-3, flops=1e9, duration_s=0.03 * (i + 1))
        run.epoch(1, val_loss=1.5)
        run.finish()

        labels = {"run_id": "run-a", "rank": "1", "gpu_uuid": f"{GPU_A},{GPU_B}"}
        assert total(store, "training_tokens_total", **labels) == 320
        assert total(store, "training_samples_total", **labels) == 20
        assert total(store, "training_steps_total", **labels) == 5
        assert total(store, "training_flops_total", **labels) == 5e9
        assert total(store, "training_loss", **labels) == pytest.approx(1.6)
        assert total(store, "training_validation_loss", **labels) == 1.5
        assert total(store, "training_learning_rate", **labels) == pytest.approx(1e-3)
        assert total(store, "training_epoch", **labels) == 1
        assert total(store, "training_run_total_steps", **labels) == 5
        assert total(store, "training_model_parameters", **labels) == 8_030_261_248  # exact in a double
        assert total(store, "training_run_finished", **labels) == 1
        assert total(store, "training_step_duration_seconds_count", **labels) == 5
        assert total(store, "training_step_duration_seconds_sum", **labels) == pytest.approx(0.45)
        # 0.03 and 0.06 are under 0.1 s; 0.09 too; 0.12 and 0.15 are not.
        assert total(store, "training_step_duration_seconds_bucket", le="0.1", **labels) == 3

        # Every training series carries the three join labels.
        for family in store.collect():
            for sample in family.samples:
                if sample.name.startswith("training_"):
                    assert sample.labels["run_id"] == "run-a" and sample.labels["rank"] == "1", sample
                    assert sample.labels["gpu_uuid"].startswith("GPU-"), sample

        (info,) = series(store, "training_run_info")
        assert dict(info) == {
            **labels, "model": "tiny-lm", "backend": "bnb", "optimizer": "adamw", "batch_size": "4",
            "grad_accum": "2", "seq_len": "16", "precision": "bf16", "seed": "7", "notes": "lora r=8",
            "world_size": "2",
        }
        assert label_values(store, "training_run_gpu_info", "gpu_uuid") == {GPU_A, GPU_B}
        (target,) = series(store, "target_info")
        assert dict(target)["service_name"] == "gpu-energy-training"
        assert dict(target)["service_instance_id"]
        assert run.dropped_exports == 0 and run.delivered_exports >= 1


@pytest.mark.parametrize(("given", "precision"), [
    # Lightning's precision settings
    ("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("16-mixed", "fp16"), ("16-true", "fp16"),
    ("32-true", "fp32"), ("32", "fp32"), ("transformer-engine", "fp8"), ("64-true", None),
    # Accelerate's mixed_precision, torch dtypes, what people write
    ("no", "fp32"), ("fp8", "fp8"), ("torch.bfloat16", "bf16"), ("float16", "fp16"), ("BF16", "bf16"),
    ("tf32", "tf32"), ("fp32", "fp32"), ("bf16_mixed", "bf16"), ("nf4", None), ("", None),
])
def test_precision_is_normalised_for_the_peak_flops_join(given: str, precision: str | None) -> None:
    from gpu_energy_exporter.core.contract import PRECISIONS
    from gpu_energy_exporter.training.metadata import normalize_precision, precision_attributes

    assert normalize_precision(given) == precision
    assert precision is None or precision in PRECISIONS
    attrs = precision_attributes(given)
    assert attrs.get("precision") == precision
    # The raw value is kept only when it says more than the normalised one.
    assert attrs.get("precision_raw") == (given if given and given.lower() != precision else None)


def test_run_metadata_is_what_the_caller_gave_over_what_the_framework_says() -> None:
    from gpu_energy_exporter.core.contract import COUNTING_ATTRIBUTES, RUN_INFO_ATTRIBUTES
    from gpu_energy_exporter.training import RunMetadata

    framework = RunMetadata(model="LitGPT", optimizer="AdamW", batch_size=8, precision="bf16-mixed",
                            precision_raw="bf16-mixed", seed=7)
    merged = RunMetadata(model="llama-3-8b", notes="try 2").over(framework)
    assert merged == RunMetadata(model="llama-3-8b", optimizer="AdamW", batch_size=8, precision="bf16-mixed",
                                 precision_raw="bf16-mixed", seed=7, notes="try 2")
    # A precision the caller gave replaces the framework's, the raw value included.
    assert RunMetadata(precision="fp16").over(framework).precision_raw is None
    attrs = merged.attributes()
    assert attrs["precision"] == "bf16" and attrs["precision_raw"] == "bf16-mixed" and attrs["backend"] is None
    assert set(attrs) <= {*RUN_INFO_ATTRIBUTES, *COUNTING_ATTRIBUTES}  # every attribute is one the contract names
    # The run's progress and parameter count fill the same way.
    framework = RunMetadata(total_steps=40, start_step=10, parameters=1000)
    assert RunMetadata(total_steps=50).over(framework) == RunMetadata(total_steps=50, start_step=10, parameters=1000)


def everything_on_the_wire(store: TrainingStore, run_id: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of run ``run_id`` the store exposes, keyed by name and labels but for the run id."""
    out = {}
    for family in store.collect():
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("run_id", None) == run_id:
                out[(sample.name, frozenset(labels.items()))] = sample.value
    return out


def test_keywords_and_run_metadata_put_the_same_points_on_the_wire() -> None:
    from gpu_energy_exporter.training import ExportSettings, RunMetadata

    fields = {"model": "tiny-lm", "backend": "bnb", "optimizer": "adamw", "batch_size": 4, "grad_accum": 2,
              "seq_len": 16, "precision": "bf16-mixed", "seed": 7, "notes": "lora r=8", "total_steps": 50,
              "start_step": 20, "parameters": 8_030_261_248, "padding": "excluded", "flops": "trainable"}
    with receiver() as (endpoint, store):
        placement = {"export_interval": 30, "gpu_uuids": [GPU_A, GPU_B], "rank": 1, "world_size": 2}
        by_name = start_run("by-name", **fields, endpoint=endpoint, **placement)
        as_object = start_run("as-object", metadata=RunMetadata(**fields),
                              export=ExportSettings(endpoint=endpoint, **placement))
        # A field given by name replaces the object's.
        mixed = start_run("mixed", metadata=RunMetadata(**{**fields, "seed": 8, "notes": "other"}), seed=7,
                          notes="lora r=8", export=ExportSettings(endpoint="http://127.0.0.1:9"),
                          endpoint=endpoint, **placement)
        for run in (by_name, as_object, mixed):
            run.step(tokens=64, samples=4, flops=1e9, duration_s=0.5)
            run.finish()
        wire = everything_on_the_wire(store, "by-name")
        info = next(dict(labels) for name, labels in wire if name == "training_run_info")
        assert (info["model"], info["precision"], info["precision_raw"], info["padding"]) == (
            "tiny-lm", "bf16", "bf16-mixed", "excluded")
        assert (info["rank"], info["world_size"], info["gpu_uuid"]) == ("1", "2", f"{GPU_A},{GPU_B}")
        assert wire[("training_run_total_steps", frozenset(
            {"rank": "1", "gpu_uuid": f"{GPU_A},{GPU_B}"}.items()))] == 50
        assert total(store, "training_global_step", run_id="by-name") == 21  # start_step 20, one step
        assert total(store, "training_model_parameters", run_id="by-name") == 8_030_261_248
        assert everything_on_the_wire(store, "as-object") == wire
        assert everything_on_the_wire(store, "mixed") == wire


def test_keywords_are_sorted_into_run_metadata_and_export_settings() -> None:
    from gpu_energy_exporter.training import ExportSettings, RunMetadata
    from gpu_energy_exporter.training.export_settings import run_keywords

    assert run_keywords(start_run, None, None, {}) == (RunMetadata(), ExportSettings())
    given = RunMetadata(model="a", seed=1)
    assert run_keywords(start_run, given, ExportSettings(rank=3), {"seed": 2, "endpoint": "http://x:1"}) == (
        RunMetadata(model="a", seed=2), ExportSettings(endpoint="http://x:1", rank=3))
    assert given.seed == 1  # frozen: the caller's object is not changed


def test_an_unknown_keyword_is_a_type_error_naming_it_and_the_valid_ones() -> None:
    import dataclasses

    from gpu_energy_exporter.training import ExportSettings, RunMetadata

    with pytest.raises(TypeError, match=r"^start_run\(\) got an unexpected keyword argument 'modle' "
                                        r"\(did you mean 'model'\?\)") as caught:
        start_run(modle="tiny-lm", endpoint="http://127.0.0.1:9", gpu_uuids=[GPU_A])
    message = str(caught.value)
    for name in ("run_id", "metadata", "export", *(f.name for f in dataclasses.fields(RunMetadata)),
                 *(f.name for f in dataclasses.fields(ExportSettings))):
        assert name in message
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'; it takes run_id"):
        start_run(zzz=1)
    with pytest.raises(ValueError, match="padding must be"):
        RunMetadata(padding="yes")
    with pytest.raises(ValueError, match="flops must be"):
        start_run(metadata=RunMetadata(flops="all"))


def test_normalised_precision_and_the_raw_value_reach_the_receiver() -> None:
    with receiver() as (endpoint, store):
        run = start_run("prec", precision="16-mixed", endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A])
        run.set_parameters(0)  # not a parameter count: no series rather than a zero that divides TT
        run.finish()
        (info,) = series(store, "training_run_info")
        assert (dict(info)["precision"], dict(info)["precision_raw"]) == ("fp16", "16-mixed")
        assert series(store, "training_model_parameters") == {}
        run = start_run("prec-raw", precision="tf32", precision_raw="32-true", endpoint=endpoint,
                        export_interval=30, gpu_uuids=[GPU_A])
        run.finish()
        infos = [dict(i) for i in series(store, "training_run_info") if dict(i)["run_id"] == "prec-raw"]
        assert [(i["precision"], i["precision_raw"]) for i in infos] == [("tf32", "32-true")]


def test_finished_is_zero_while_running_and_steps_after_finish_are_ignored() -> None:
    with receiver() as (endpoint, store):
        run = start_run(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A])
        run.step(tokens=10, samples=1)
        assert run.flush() is True
        assert list(series(store, "training_run_finished").values()) == [0]
        assert list(series(store, "training_tokens_total").values()) == [10]
        run.finish()
        run.finish()  # idempotent
        run.step(tokens=1000, samples=1)
        assert run.tokens == 10 and run.steps == 1
        assert list(series(store, "training_run_finished").values()) == [1]
        # A generated run id is readable and sortable: YYYYmmdd-HHMMSS-hex.
        (run_id,) = label_values(store, "training_tokens_total", "run_id")
        assert run_id == run.run_id and len(run_id.split("-")) == 3


def test_context_manager_finishes_even_when_training_raises() -> None:
    with receiver() as (endpoint, store):
        with pytest.raises(RuntimeError, match="boom"), start_run(endpoint=endpoint, export_interval=30,
                                                                  gpu_uuids=[GPU_A]) as run:
            run.step(tokens=5)
            raise RuntimeError("boom")
        assert run.finished
        assert list(series(store, "training_run_finished").values()) == [1]
        assert list(series(store, "training_tokens_total").values()) == [5]


class LazyNumber:
    """Stands for a device tensor: counts how often it is converted (a device sync each time)."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.conversions = 0

    def __float__(self) -> float:
        self.conversions += 1
        return self.value


def test_loss_is_converted_at_export_time_not_in_step() -> None:
    loss = LazyNumber(3.25)
    with receiver() as (endpoint, store):
        run = start_run(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A])
        # start_run's first export runs in a thread of its own: wait for it, so that on a loaded machine it
        # does not collect (and convert) the loss the steps below set (it would, rightly, in its thread)
        deadline = time.monotonic() + 30
        while run.delivered_exports < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.delivered_exports == 1
        for _ in range(100):
            run.step(tokens=1, loss=loss)
        assert loss.conversions == 0
        run.finish()
        assert loss.conversions == 1
        assert list(series(store, "training_loss").values()) == [3.25]


def test_standard_otel_endpoint_variables_are_honoured() -> None:
    assert resolve_endpoint(None, {}) == "http://localhost:4318/v1/metrics"
    assert resolve_endpoint("http://node:4318", {}) == "http://node:4318/v1/metrics"
    assert resolve_endpoint("node:4318/", {}) == "http://node:4318/v1/metrics"
    assert resolve_endpoint("http://node:4318/v1/metrics", {}) == "http://node:4318/v1/metrics"
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert resolve_endpoint(None, base) == "http://collector:4318/v1/metrics"
    signal = {**base, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://gw/custom/path"}
    assert resolve_endpoint(None, signal) == "https://gw/custom/path"  # used as is, per the spec
    assert resolve_endpoint("http://explicit:1", signal) == "http://explicit:1/v1/metrics"

    with receiver() as (endpoint, store):
        run = start_run(gpu_uuids=[GPU_A], environ={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                                                    "OTEL_METRIC_EXPORT_INTERVAL": "30000"})
        run.step(tokens=3)
        run.finish()
        assert run.endpoint == endpoint + "/v1/metrics"
        assert list(series(store, "training_tokens_total").values()) == [3]


def test_a_script_that_never_calls_finish_still_flushes_at_exit() -> None:
    with receiver() as (endpoint, store):
        proc = run_child(f"""
        from gpu_energy_exporter.training import start_run
        run = start_run("no-finish", endpoint={endpoint!r}, export_interval=3600, gpu_uuids=[{GPU_A!r}])
        for _ in range(7):
            run.step(tokens=3, samples=1)
        """)
        assert proc.returncode == 0, proc.stderr
        assert total(store, "training_tokens_total", run_id="no-finish") == 21
        assert total(store, "training_run_finished", run_id="no-finish") == 1


def test_run_id_and_rank_from_the_environment() -> None:
    with receiver() as (endpoint, store):
        env = {"GPU_ENERGY_RUN_ID": "shared-id", "RANK": "3", "WORLD_SIZE": "4"}
        run = start_run(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A], environ=env)
        run.finish()
        assert (run.run_id, run.rank, run.world_size) == ("shared-id", 3, 4)
        assert label_values(store, "training_run_info", "world_size") == {"4"}
        # Without any shared id, ranks of an elastic job agree through TORCHELASTIC_RUN_ID.
        run = start_run(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A],
                        environ={"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"})
        run.finish()
        assert run.run_id == "elastic-abc"


# ----------------------------------------------------------------------------------------------------
# an unreachable, hung or returning endpoint


def test_unreachable_endpoint_never_disturbs_training(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    caplog.set_level(logging.DEBUG)
    run = start_run(endpoint=endpoint, export_interval=0.05, export_timeout=0.3, gpu_uuids=[GPU_A])
    for _ in range(40):
        run.step(tokens=8, samples=1, loss=1.0)
        time.sleep(0.01)
    deadline = time.monotonic() + 5
    while run.dropped_exports < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    run.finish()  # the endpoint is known to be down: the final export gets a short chance, not 5 s
    assert time.monotonic() - started < 3.0
    assert run.tokens == 320 and run.steps == 40
    assert run.dropped_exports >= 2 and run.delivered_exports == 0

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    ours = [r for r in warnings if r.name == LOGGER]
    assert len(ours) == 1, [r.getMessage() for r in warnings]
    assert endpoint in ours[0].getMessage() and "dropped_exports" in ours[0].getMessage()
    # The SDK's own per-export errors and per-retry warnings are captured, not printed.
    assert not [r for r in caplog.records if r.name.startswith(("opentelemetry", "urllib3"))
                and r.levelno >= logging.WARNING]


def test_finish_is_bounded_when_the_endpoint_hangs() -> None:
    # A socket that listens but never accepts: connections open, requests get no answer.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        run = start_run(endpoint=endpoint, export_interval=0.05, export_timeout=30, gpu_uuids=[GPU_A])
        run.step(tokens=1)
        time.sleep(0.2)  # the background export is now stuck waiting for an answer
        started = time.monotonic()
        run.finish(timeout=0.5)
        assert time.monotonic() - started < 2.0
        assert run.finished


def test_totals_catch_up_when_the_endpoint_comes_back() -> None:
    port = closed_port()
    run = start_run(endpoint=f"http://127.0.0.1:{port}", export_interval=0.05, export_timeout=0.2,
                    gpu_uuids=[GPU_A])
    run.step(tokens=100, samples=2)
    deadline = time.monotonic() + 5
    while run.dropped_exports == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert run.dropped_exports > 0
    store = TrainingStore()
    server = OTLPReceiver(("127.0.0.1", port), store).start()
    try:
        run.step(tokens=50, samples=1)
        deadline = time.monotonic() + 5
        while run.delivered_exports == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        run.finish()
        # Cumulative counters: nothing recorded during the outage is lost.
        assert list(series(store, "training_tokens_total").values()) == [150]
        assert list(series(store, "training_samples_total").values()) == [3]
    finally:
        server.shutdown()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_forked_child_never_exports_its_stale_copy() -> None:
    # DataLoader workers are forked from the trainer; the SDK restarts its export thread in the child,
    # whose copy of the totals stops at the fork. If it exported, the receiver would see the counter go
    # back and fold it as a restart, inflating the total.
    with receiver() as (endpoint, store):
        run = start_run(endpoint=endpoint, export_interval=0.05, gpu_uuids=[GPU_A])
        run.step(tokens=10)
        child = multiprocessing.get_context("fork").Process(target=_sleep, args=(0.6,))
        child.start()
        for _ in range(30):
            run.step(tokens=10)
            time.sleep(0.02)
        child.join(10)
        assert child.exitcode == 0
        run.finish()
        assert list(series(store, "training_tokens_total").values()) == [310]


def test_hot_path_cost_is_small() -> None:
    run = start_run(endpoint=f"http://127.0.0.1:{closed_port()}", export_interval=3600, finish_timeout=0.2,
                    gpu_uuids=[GPU_A])
    n = 20000
    seconds = min(timeit.repeat(lambda: run.step(tokens=512, samples=4, loss=1.5, lr=1e-4, flops=1e12),
                                number=n, repeat=3))
    run.finish()
    print(f"\nTrainingRun.step(): {seconds / n * 1e6:.2f} µs per call (design target: under 5 µs)")
    assert run.steps == 3 * n and run.tokens == 3 * n * 512


# ----------------------------------------------------------------------------------------------------
# counting batches


def test_count_batch_reads_shapes_only() -> None:
    import torch

    ids = torch.zeros((4, 16), dtype=torch.int64)
    assert count_batch(ids) == (4, 64)
    assert count_batch({"input_ids": ids, "attention_mask": torch.ones((4, 16), dtype=torch.bool)}) == (4, 64)
    assert count_batch({"labels": torch.zeros(4), "input_ids": ids.int()}) == (4, 64)
    assert count_batch((ids, torch.zeros(4))) == (4, 64)
    assert count_batch([{"input_ids": ids}, "meta"]) == (4, 64)
    assert count_batch(torch.zeros((8, 3, 32, 32))) == (8, 0)  # images: samples only
    assert count_batch(torch.zeros((8, 3, 32, 32), dtype=torch.uint8)) == (8, 0)
    assert count_batch({"pixel_values": torch.zeros((2, 3, 8, 8))}, "pixel_values") == (2, 0)
    assert count_batch("not a batch") == (0, 0)


# ----------------------------------------------------------------------------------------------------
# which GPUs: pure data


# NVML lists GPUs in its own order; CUDA ordinals follow PCI bus order (see gpus.py).
NODE = [
    NVMLGPU("GPU-cccccccc-0000-0000-0000-000000000003", "00000000:9A:00.0", "NVIDIA H100"),
    NVMLGPU("GPU-aaaaaaaa-0000-0000-0000-000000000001", "00000000:18:00.0", "NVIDIA H100"),
    NVMLGPU("GPU-bbbbbbbb-0000-0000-0000-000000000002", "00000000:2A:00.0", "NVIDIA H100",
            mig_uuids=("MIG-dddddddd-0000-0000-0000-000000000001", "MIG-eeeeeeee-0000-0000-0000-000000000002")),
]
ORD0, ORD1, ORD2 = NODE[1].uuid, NODE[2].uuid, NODE[0].uuid


def nvml_node() -> list[NVMLGPU]:
    return list(NODE)


def no_nvml() -> list[NVMLGPU]:
    raise NVMLMissing("the pynvml module is not installed (test)")


def test_parse_visible_devices_follows_cuda() -> None:
    assert parse_visible_devices("0,2") == [0, 2]
    assert parse_visible_devices(" 1 , 0") == [1, 0]
    assert parse_visible_devices("1,-1,0") == [1]  # a negative index ends the list
    assert parse_visible_devices("-1") == []  # the idiom that hides every GPU
    assert parse_visible_devices("") == []
    assert parse_visible_devices("0,0") == []  # a repeat empties the list
    assert parse_visible_devices("1gpu,2") == [1, 2]  # strtoul reads the leading digits
    assert parse_visible_devices("0,x,1") == [0]
    assert parse_visible_devices("GPU-aaa,GPU-bbb") == ["GPU-aaa", "GPU-bbb"]
    assert parse_visible_devices("GPU-aaa,1") == ["GPU-aaa"]  # the first entry decides the form
    assert parse_visible_devices("MIG-xyz") == ["MIG-xyz"]


def test_indices_are_cuda_ordinals_in_pci_bus_order_not_nvml_indices() -> None:
    assert map_visible_devices([0], NODE) == [ORD0]
    assert map_visible_devices([2, 0], NODE) == [ORD2, ORD0]
    assert map_visible_devices([1, 7, 0], NODE) == [ORD1]  # stops at the first missing GPU
    env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert resolve_gpus(environ=env, nvml_reader=nvml_node).uuids == (ORD1,)


def test_uuids_prefixes_resolve_and_mig_instances_keep_their_uuids() -> None:
    def resolve(visible: str) -> tuple[str, ...]:
        return resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": visible}, nvml_reader=nvml_node).uuids

    assert resolve("GPU-cccccccc") == (NODE[0].uuid,)  # unique prefix
    assert resolve("GPU-bbbbbbbb-0000-0000-0000-000000000002,GPU-aaaa") == (ORD1, ORD0)
    mig_d, mig_e = NODE[2].mig_uuids
    assert resolve("MIG-eeee") == (mig_e,)  # a MIG instance keeps its UUID (the exporter knows its parent)
    assert resolve("MIG-dddd,MIG-eeee") == (mig_d, mig_e)  # two instances: two devices (issue 19)
    assert resolve("MIG-GPU-aaaaaaaa-0000-0000-0000-000000000001/1/0") == (ORD0,)  # legacy form
    assert resolve("GPU-0000") == ()  # matches nothing: nothing visible
    assert resolve_gpus(["MIG-dddddddd"], nvml_reader=nvml_node).uuids == (mig_d,)


def test_the_order_of_answers() -> None:
    explicit = resolve_gpus([GPU_B], device="cpu", environ={"CUDA_VISIBLE_DEVICES": "0"}, nvml_reader=no_nvml)
    assert (explicit.uuids, explicit.source, explicit.label) == ((GPU_B,), "explicit", GPU_B)
    cpu = resolve_gpus(device="cpu", environ={"CUDA_VISIBLE_DEVICES": "0"}, nvml_reader=nvml_node)
    assert (cpu.uuids, cpu.label) == ((), "none")
    hidden = resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": "-1"}, nvml_reader=nvml_node)
    assert (hidden.uuids, hidden.label) == ((), "none")
    every = resolve_gpus(environ={}, nvml_reader=nvml_node)
    assert (every.uuids, every.source) == ((ORD0, ORD1, ORD2), "nvml-all")


def test_device_uuids_from_torch_map_to_parent_gpus() -> None:
    # torch prints a device UUID without NVML's prefix; a MIG instance's UUID is not its GPU's.
    assert _from_torch("cccccccc-0000-0000-0000-000000000003", nvml_node) == (NODE[0].uuid,)
    assert _from_torch("eeeeeeee-0000-0000-0000-000000000002", nvml_node) == (NODE[2].mig_uuids[1],)
    assert _from_torch("12345678-0000-0000-0000-000000000000", no_nvml) == ("GPU-12345678-0000-0000-0000-000000000000",)
    assert _from_torch(GPU_A, no_nvml) == (GPU_A,)
    assert _from_torch("not-a-uuid", nvml_node) == ()


def test_without_nvml_complete_uuids_still_work_and_indices_are_unknown() -> None:
    full = resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}"}, nvml_reader=no_nvml)
    assert full.label == f"{GPU_A},{GPU_B}"
    legacy = resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": f"MIG-{GPU_A}/3/0"}, nvml_reader=no_nvml)
    assert legacy.uuids == (GPU_A,)
    mig = resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": "MIG-dddddddd-0000-0000-0000-000000000001"},
                       nvml_reader=no_nvml)
    assert mig.uuids == ("MIG-dddddddd-0000-0000-0000-000000000001",)  # complete: no NVML needed
    for visible in ("0", "GPU-1111", "MIG-dddd"):
        unknown = resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": visible}, nvml_reader=no_nvml)
        assert (unknown.uuids, unknown.label) == ((), "unknown")


# ----------------------------------------------------------------------------------------------------
# which GPUs: the real pynvml against the fake driver library, and no NVML at all


RESOLVE = """
import json
from gpu_energy_exporter.training.gpus import resolve_gpus
print(json.dumps(resolve_gpus().label))
"""


def test_cuda_visible_devices_through_real_pynvml(tmp_path: Path) -> None:
    lib = build_library(tmp_path / "lib")
    # NVML index 0 sits on a later PCI bus than index 1: CUDA ordinal 0 is NVML's GPU 1.
    late = h100(0, pci_bus_id="00000000:DB:00.0")
    early = v100(1, pci_bus_id="00000000:18:00.0")
    mig_parent = h100(2, pci_bus_id="00000000:5D:00.0")
    migs = mig_uuids(mig_parent.uuid, 2)
    Scenario(epoch=time.time(), gpus=[late, early, h100(2, pci_bus_id="00000000:5D:00.0", mig_mode=1,
                                                        mig_devices=migs)]).write(tmp_path / "sc.ini")
    env = {"LD_LIBRARY_PATH": str(lib.parent), "FAKE_NVML_SCENARIO": str(tmp_path / "sc.ini")}

    def label(**extra: str) -> str:
        proc = run_child(RESOLVE, **env, **extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert label(CUDA_VISIBLE_DEVICES="0") == early.uuid
    assert label(CUDA_VISIBLE_DEVICES="2,0", CUDA_DEVICE_ORDER="PCI_BUS_ID") == f"{late.uuid},{early.uuid}"
    assert label(CUDA_VISIBLE_DEVICES=late.uuid[:12]) == late.uuid
    assert label(CUDA_VISIBLE_DEVICES=migs[1]) == migs[1]  # a MIG instance keeps its UUID (issue 19)
    assert label() == ",".join([early.uuid, mig_parent.uuid, late.uuid])  # nothing said: all of them


def test_without_nvml_training_continues_with_one_warning() -> None:
    script = """
    import sys
    sys.modules["pynvml"] = None  # as if nvidia-ml-py were not installed
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    from training_models import closed_port
    from gpu_energy_exporter.training import start_run
    for _ in range(3):
        run = start_run(endpoint=f"http://127.0.0.1:{closed_port()}", export_interval=3600,
                        finish_timeout=0.2, environ={"CUDA_VISIBLE_DEVICES": "0"})
        run.step(tokens=5)
        print("LABEL", run._attrs["gpu_uuid"], run.tokens)
        run.finish()
    """
    proc = run_child(script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split().count("LABEL") == 3
    assert "LABEL unknown 5" in proc.stdout
    nvml_warnings = [line for line in proc.stderr.splitlines() if "cannot tell which GPUs" in line]
    assert len(nvml_warnings) == 1, proc.stderr
    assert "pynvml module is not installed" in nvml_warnings[0]


def test_importing_the_helper_pulls_in_nothing_heavy() -> None:
    proc = run_child("""
    import sys
    import gpu_energy_exporter.core.contract as names
    assert not [m for m in sys.modules if m.startswith("opentelemetry.sdk")], "SDK imported"
    from gpu_energy_exporter.training import start_run
    heavy = [m for m in ("torch", "transformers", "lightning", "pynvml") if m in sys.modules]
    print("HEAVY", heavy, names.TOKENS.name)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY [] training.tokens" in proc.stdout


@pytest.mark.gpu
def test_real_gpu_device_resolves_to_its_nvml_uuid() -> None:
    # Three independent routes must name the same GPU: torch's CUDA UUID of the framework device, torch's
    # current device, and CUDA ordinal 0 mapped through NVML by PCI bus order.
    proc = run_child("""
    import json
    import torch
    from gpu_energy_exporter.training.gpus import read_nvml_gpus, resolve_gpus
    if not torch.cuda.is_available():
        print(json.dumps({"skip": "needs PyTorch with CUDA and a visible GPU"}))
        raise SystemExit
    torch.ones(1, device="cuda:0")
    print(json.dumps({
        "device": resolve_gpus(device=torch.device("cuda:0")).uuids,
        "current": resolve_gpus(environ={}).uuids,
        "visible": resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).uuids,
        "nvml": [g.uuid for g in read_nvml_gpus()],
    }))
    """, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    print(json.dumps(out, indent=2))
    assert len(out["device"]) == 1 and out["device"][0].startswith("GPU-")
    assert out["device"] == out["current"] == out["visible"]
    assert out["device"][0] in out["nvml"]



# ----------------------------------------------------------------------------------------------------
# padding, FLOPs per token, resumed runs, CPU runs


def test_count_tokens_excludes_padding_from_the_attention_mask() -> None:
    import torch

    from gpu_energy_exporter.training import count_tokens

    ids = torch.zeros((4, 16), dtype=torch.int64)
    mask = torch.ones((4, 16), dtype=torch.int64)
    mask[:, 10:] = 0  # 6 padding positions per row
    mask[0, 8:] = 0  # row 0 has 8
    batch = {"input_ids": ids, "attention_mask": mask}
    counted = count_tokens(batch)
    # A 0-d tensor: attention_mask.sum() launched, not read back (no device synchronisation).
    assert isinstance(counted, torch.Tensor) and counted.dim() == 0 and int(counted) == 4 * 16 - 3 * 6 - 8
    assert count_tokens(batch, padding=True) == 64
    assert count_tokens({"input_ids": ids}) == 64  # no mask: every position
    assert int(count_tokens({"input_ids": ids, "attention_mask": mask.bool()})) == 38
    assert int(count_tokens({"input_ids": ids, "attention_mask": mask.float()})) == 38
    assert count_tokens({"input_ids": ids, "attention_mask": torch.ones((4, 1, 16, 16))}) == 64  # not per token
    assert count_tokens(ids) == 64  # a bare tensor has no mask

    # A plain loop passes the device-side counts to step(); the totals are read at export time.
    with receiver() as (endpoint, store):
        run = start_run("padded", endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A], padding="excluded")
        for _ in range(5):
            run.step(tokens=count_tokens(batch), samples=4)
        run.add(tokens=count_tokens(batch))
        assert run.tokens == 6 * 38
        run.finish()
        assert total(store, "training_tokens_total") == 6 * 38
        (info,) = series(store, "training_run_info")
        assert dict(info)["padding"] == "excluded"
    with pytest.raises(ValueError, match="padding must be"):
        start_run(padding="yes", endpoint=endpoint, gpu_uuids=[GPU_A])


def test_flops_per_token_counts_weight_gradients_of_trainable_parameters_only() -> None:
    import torch

    from gpu_energy_exporter.training.flops import flops_per_token, parameter_counts

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 32), torch.nn.Linear(32, 64))
    n = (8 * 32 + 32) + (32 * 64 + 64)  # the embedding is a lookup, not a matmul: left out
    assert parameter_counts(model) == (n, n)
    assert flops_per_token(model) == flops_per_token(model, "total") == 6 * n  # full training: 6N
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = torch.nn.Linear(8, 2, bias=False)
    model.append(adapter)  # a trainable extra module: 16 parameters
    assert parameter_counts(model) == (n + 16, 16)
    assert flops_per_token(model) == 4 * (n + 16) + 2 * 16
    assert flops_per_token(model, "total") == 6 * (n + 16)
    with pytest.raises(ValueError, match="flops must be"):
        flops_per_token(model, "some")
    assert flops_per_token(object()) is None


def test_a_resumed_run_reports_its_global_step() -> None:
    with receiver() as (endpoint, store):
        run = start_run("resumed", endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A], total_steps=10,
                        start_step=5)
        assert run.flush() is True
        # Halfway at the start, not 0%.
        assert total(store, "training_global_step") == 5 and total(store, "training_run_total_steps") == 10
        run.step(tokens=1)
        run.step(tokens=1)
        assert run.global_step == 7 and run.steps == 2
        run.step(tokens=1, global_step=9)  # a framework's own count wins
        run.finish()
        assert total(store, "training_global_step") == 9
        assert total(store, "training_steps_total") == 3  # steps this process took


def test_a_machine_without_an_nvidia_driver_runs_on_cpu_gpu_uuid_none() -> None:
    from gpu_energy_exporter.training.gpus import NoNVIDIADriver

    def no_driver() -> list[NVMLGPU]:
        raise NoNVIDIADriver("no NVIDIA driver on this machine (NVML Shared Library Not Found)")

    cpu = resolve_gpus(environ={}, nvml_reader=no_driver)
    assert (cpu.uuids, cpu.label) == ((), "none")
    # pynvml present, NVML failing otherwise: which GPUs is unknown.
    assert resolve_gpus(environ={}, nvml_reader=no_nvml).label == "unknown"
    # Indices need NVML to resolve: unknown too, even without a driver library.
    assert resolve_gpus(environ={"CUDA_VISIBLE_DEVICES": "0"}, nvml_reader=no_driver).label == "unknown"


def test_cpu_only_machine_through_real_pynvml_reports_none(tmp_path: Path) -> None:
    # The real pynvml, with LD_LIBRARY_PATH at an empty folder: on a machine without the NVIDIA driver
    # libnvidia-ml.so.1 is not found, as on a laptop or a CPU node. (A GPU machine finds the real one.)
    import ctypes.util

    proc = run_child("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    from gpu_energy_exporter.training import start_run
    from training_models import closed_port
    run = start_run(endpoint=f"http://127.0.0.1:{closed_port()}", export_interval=3600, finish_timeout=0.2)
    print("LABEL", run._attrs["gpu_uuid"])
    """, LD_LIBRARY_PATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    if ctypes.util.find_library("nvidia-ml"):
        assert "LABEL GPU-" in proc.stdout, proc.stdout  # a GPU machine: its GPUs
        return
    assert "LABEL none" in proc.stdout, proc.stdout
    assert "cannot tell which GPUs" not in proc.stderr, proc.stderr


def test_token_counts_of_any_kind_never_raise_into_the_loop() -> None:
    import torch

    from gpu_energy_exporter.training.batch import add_count

    assert int(add_count(0, torch.tensor(3))) == 3 and int(add_count(torch.tensor(3), 4)) == 7
    assert add_count(5, None) == 5 and add_count(0, None) == 0 and add_count(2, "x") == 2
    run = start_run(endpoint=f"http://127.0.0.1:{closed_port()}", export_interval=3600, finish_timeout=0.2,
                    gpu_uuids=[GPU_A])
    for tokens in (None, "x", torch.tensor(5), 2, torch.tensor(1.0)):
        run.step(tokens=tokens)  # type: ignore[arg-type]
    run.add(tokens=None)  # type: ignore[arg-type]
    assert run.tokens == 8 and run.steps == 5
    run.finish()
