"""The training contract: the OpenTelemetry instruments a training process pushes (names, kinds, units,
attributes) and the Prometheus names they arrive under.

This is the contract between the training-side helper, the exporter's OTLP receiver (and any OpenTelemetry
Collector in between), the run ledger, the rules and dashboards builder and the docs: every one of them
takes these names from here, none retypes them. A dashboard built on the Prometheus translation
(``training_tokens_total``, ``training_step_duration_seconds``...) works whatever carried the points:
``Instrument.prometheus`` is what the OpenTelemetry -> Prometheus compatibility rules give for the
instrument (tests/test_otlp_translate.py checks each against ``otlp.naming.metric_name``). The module is
plain data: it imports neither the OpenTelemetry SDK nor torch nor anything else of the package. It must
never grow logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

InstrumentKind = Literal["counter", "gauge", "histogram"]

#: Resource ``service.name`` of every training process.
SERVICE_NAME = "gpu-energy-training"

#: Instrumentation scope (meter) name.
SCOPE_NAME = "gpu_energy_exporter.training"

#: Data-point attributes carried by every point, on every instrument.
ATTR_RUN_ID = "run_id"
ATTR_RANK = "rank"
ATTR_GPU_UUID = "gpu_uuid"  # comma-joined when the process uses several GPUs
POINT_ATTRIBUTES: tuple[str, ...] = (ATTR_RUN_ID, ATTR_RANK, ATTR_GPU_UUID)

#: Resource attributes the helper sends to say which process pushed (OpenTelemetry semantic conventions where
#: one exists), and the labels they arrive under after translation (``target_info`` and the ledger's view of a
#: point's resource). The ledger ties a run to the processes NVML lists with them: the pid (in the trainer's
#: own pid namespace), the container it runs in (from its cgroup), and the job identity every rank of one job
#: shares (a run id pushed by a process whose job identity disagrees is refused, not merged).
RESOURCE_PROCESS_PID, LABEL_PROCESS_PID = "process.pid", "process_pid"
RESOURCE_HOST_NAME, LABEL_HOST_NAME = "host.name", "host_name"
RESOURCE_CONTAINER_ID, LABEL_CONTAINER_ID = "container.id", "container_id"
RESOURCE_POD_UID, LABEL_POD_UID = "k8s.pod.uid", "k8s_pod_uid"
RESOURCE_SLURM_JOB_ID, LABEL_SLURM_JOB_ID = "slurm.job.id", "slurm_job_id"
#: torchrun's rendezvous id (TORCHELASTIC_RUN_ID), else MASTER_ADDR:MASTER_PORT: the same on every rank of one job.
RESOURCE_JOB_ID, LABEL_JOB_ID = "training.job.id", "training_job_id"
RESOURCE_WORLD_SIZE, LABEL_WORLD_SIZE = "training.world_size", "training_world_size"
#: The labels that make a job's identity (compared when a new process pushes under a run id).
JOB_IDENTITY_LABELS: tuple[str, ...] = (LABEL_SLURM_JOB_ID, LABEL_JOB_ID, LABEL_WORLD_SIZE)

#: Extra attributes of ``training.run.info`` (the run's metadata). Absent when not known.
RUN_INFO_ATTRIBUTES: tuple[str, ...] = (
    "model", "backend", "optimizer", "batch_size", "grad_accum", "seq_len", "precision", "precision_raw",
    "seed", "notes", "world_size",
)

#: Attributes of ``training.run.info`` saying how tokens and FLOPs were counted (absent when the caller did
#: not say). ``padding``: ``excluded`` (tokens are the attention mask's non-padding positions) or
#: ``included`` (every position of the token-id tensor, padding too). ``flops``: ``trainable``
#: (``4 * N + 2 * N_trainable`` per token: a frozen base's weight gradients are not computed) or ``total``
#: (``6 * N``, what Hugging Face's ``total_flos`` counts); see docs/training.md.
COUNTING_ATTRIBUTES: tuple[str, ...] = ("padding", "flops")
PADDING_EXCLUDED = "excluded"
PADDING_INCLUDED = "included"
FLOPS_TRAINABLE = "trainable"
FLOPS_TOTAL = "total"

#: Values of the ``precision`` attribute: the compute precision of the run's matrix multiplications, as
#: the exporter's peak-FLOP/s table names them (``gpuenergy_gpu_peak_flops_per_second{precision}``, which
#: has no fp32 row: an fp32 run gets no MFU rather than a wrong one). What the framework or the caller
#: said (``"bf16-mixed"``, ``"16-mixed"``...) is kept in ``precision_raw`` when it differs.
PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp8", "tf32", "fp32")

#: ``gpu_uuid`` values that are not GPUs: the process uses no GPU (a CPU device, CUDA_VISIBLE_DEVICES
#: hides every GPU), or which GPUs it uses could not be found out (no NVML, ambiguous).
GPU_NONE = "none"
GPU_UNKNOWN = "unknown"


def gpu_key(uuid: str) -> str:
    """A GPU or MIG uuid as ``gpu_uuid`` values are compared: without case or the ``GPU-`` prefix (torch reports
    UUIDs without it, NVML with it)."""
    key = uuid.strip().lower()
    return key[4:] if key.startswith("gpu-") else key


@dataclass(frozen=True)
class Instrument:
    name: str  # the OpenTelemetry instrument name
    kind: InstrumentKind
    unit: str
    prometheus: str  # the Prometheus name (counters with ``_total``; a histogram's base name)
    description: str


TOKENS = Instrument("training.tokens", "counter", "{token}", "training_tokens_total",
                    "Tokens processed by this rank (each token counted once across ranks; padding "
                    "excluded or included as the run's padding attribute says).")
SAMPLES = Instrument("training.samples", "counter", "{sample}", "training_samples_total",
                     "Samples (sequences) processed by this rank.")
STEPS = Instrument("training.steps", "counter", "{step}", "training_steps_total",
                   "Optimizer steps taken by this rank (in data parallelism every rank takes every step: "
                   "aggregate over ranks with max, not sum).")
FLOPS = Instrument("training.flops", "counter", "{flop}", "training_flops_total",
                   "Model FLOPs of this rank's training steps, forward and backward, counted step by step "
                   "(the run's flops attribute says whether frozen weights' gradients are counted).")
LOSS = Instrument("training.loss", "gauge", "", "training_loss", "Latest training loss.")
VALIDATION_LOSS = Instrument("training.validation.loss", "gauge", "", "training_validation_loss",
                             "Latest validation loss.")
LEARNING_RATE = Instrument("training.learning_rate", "gauge", "", "training_learning_rate", "Latest learning rate.")
EPOCH = Instrument("training.epoch", "gauge", "", "training_epoch", "Epochs completed (fractional during an epoch).")
STEP_DURATION = Instrument("training.step.duration", "histogram", "s", "training_step_duration_seconds",
                           "Wall time of one optimizer step.")
RUN_INFO = Instrument("training.run.info", "gauge", "", "training_run_info",
                      "Always 1; the run's metadata (model, backend, optimizer, ...) as attributes.")
RUN_GPU_INFO = Instrument("training.run.gpu.info", "gauge", "", "training_run_gpu_info",
                          "Always 1; one point per GPU this rank uses, with that GPU's gpu_uuid.")
GLOBAL_STEP = Instrument("training.global_step", "gauge", "{step}", "training_global_step",
                         "The trainer's optimizer step counted from the start of training, steps taken before a "
                         "resume included (progress is this over training.run.total_steps).")
RUN_TOTAL_STEPS = Instrument("training.run.total_steps", "gauge", "", "training_run_total_steps",
                             "Optimizer steps the whole training is planned to take (the trainer's max steps, "
                             "steps before a resume included), when known.")
RUN_FINISHED = Instrument("training.run.finished", "gauge", "", "training_run_finished",
                          "0 while the run is going, 1 after it finished.")
MODEL_PARAMETERS = Instrument("training.model.parameters", "gauge", "{parameter}", "training_model_parameters",
                              "Parameters of the whole model being trained (trainable or not; the same value on "
                              "every rank, aggregate with max), when known. For TT and ST (per parameter).")

ALL: tuple[Instrument, ...] = (
    TOKENS, SAMPLES, STEPS, FLOPS, LOSS, VALIDATION_LOSS, LEARNING_RATE, EPOCH, STEP_DURATION, RUN_INFO,
    RUN_GPU_INFO, GLOBAL_STEP, RUN_TOTAL_STEPS, RUN_FINISHED, MODEL_PARAMETERS,
)

#: Explicit bucket bounds of ``training.step.duration``, in seconds: from a millisecond (tiny models) to
#: five minutes (large models with long gradient accumulation). OpenTelemetry's default bounds are meant
#: for milliseconds and would put every step in one bucket.
STEP_DURATION_BOUNDS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0,
)
