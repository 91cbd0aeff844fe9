"""Which GPUs this training process uses, as NVML UUIDs: the key that joins its tokens to the energy the
exporter reports for exactly those GPUs.

Resolution, first answer wins:

1. ``gpu_uuids=[...]`` passed explicitly (full ``GPU-...`` UUIDs, or ``MIG-...``).
2. A framework device (the Hugging Face and Lightning callbacks pass the device the trainer put the
   model on): ``torch.cuda.get_device_properties(d).uuid``. A CPU device means "no GPU".
3. A distributed rank (``WORLD_SIZE`` > 1) whose torch already initialised CUDA: the current device.
   ``torchrun`` leaves ``CUDA_VISIBLE_DEVICES`` listing every GPU of the node and each rank picks one
   with ``torch.cuda.set_device``, so the visible list would claim all of them.
4. ``CUDA_VISIBLE_DEVICES``: every GPU it makes visible (a single process may drive several GPUs, e.g.
   ``device_map="auto"``).
5. torch's current device, when CUDA is already initialised.
6. Every GPU NVML can see (one warning if there are several: pass ``gpu_uuids`` or set
   ``CUDA_VISIBLE_DEVICES`` to be exact). A machine without an NVIDIA driver (NVML's library absent or
   the driver not loaded) has none: a CPU run, ``gpu_uuid="none"``.

``gpu_uuid="none"`` means the process uses no GPU (a CPU device, every GPU hidden, no NVIDIA driver);
``"unknown"`` means it may use GPUs but which could not be found out (no ``pynvml``, NVML failing on a
machine that has a driver, indices or prefixes that need NVML to resolve).

``CUDA_VISIBLE_DEVICES`` follows CUDA's own parsing (as torch re-implements it): the first entry decides
the form (indices, ``GPU-`` UUIDs or ``MIG-`` UUIDs); UUIDs may be unique prefixes; parsing stops at the
first invalid entry (so ``-1`` hides every GPU); a repeated entry makes the list empty. Indices are
**CUDA ordinals, not NVML indices**: CUDA numbers devices fastest first unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and NVML's order is not guaranteed at all. We therefore sort the GPUs
NVML reports by PCI bus id; that is CUDA's order under ``PCI_BUS_ID`` and also under the default when
all GPUs are the same model (CUDA breaks "fastest" ties by bus id). On a node with mixed models and the
default order the mapping is ambiguous: we say so once and recommend ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

MIG: a MIG instance keeps its own ``MIG-`` UUID (issue 19: replacing it with its parent's made two runs on
a 3g and a 1g slice two runs on one whole GPU). NVML has no per-instance energy; the exporter knows each
instance's parent and its compute slices, and charges the instance its slices' share of the parent's
energy. Only the legacy ``MIG-GPU-<parent>/<gi>/<ci>`` form, which names no instance UUID, maps to its parent.

This module must never make training fail, never create a CUDA context (torch is consulted only when it
is already imported and CUDA already initialised, or for a device a framework already uses), and never
import torch itself. NVML (``pynvml``) is imported lazily and optional: without it, index entries and
prefixes cannot be resolved and the answer degrades to ``"unknown"`` with one warning per process.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_energy_exporter.core.contract import GPU_NONE, GPU_UNKNOWN

log = logging.getLogger("gpu_energy_exporter.training")

_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# Legacy MIG identifiers (drivers before R470): MIG-GPU-<parent uuid>/<gi>/<ci>.
_LEGACY_MIG_RE = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]{36})/\d+/\d+$")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, message: str, *args: object, exc_info: bool = False) -> None:
    # Capability problems are logged once per process (not once per run, not per step).
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args, exc_info=exc_info)


@dataclass(frozen=True)
class NVMLGPU:
    """What we need to know about one physical GPU, as NVML reports it."""

    uuid: str  # "GPU-..."
    pci_bus_id: str  # "00000000:17:00.0"
    name: str = ""
    mig_uuids: tuple[str, ...] = ()  # "MIG-..." of its MIG devices, when MIG is enabled


class NVMLMissing(Exception):
    """NVML cannot be used in this process (no pynvml, no driver library, init failed)."""


class NoNVIDIADriver(NVMLMissing):
    """This machine has no NVIDIA driver (its NVML library is absent or not loaded): a process here
    cannot be using an NVIDIA GPU."""


@dataclass(frozen=True)
class GPUResolution:
    """The answer: ``uuids`` (parent GPU UUIDs, in the process's device order) and where it came from."""

    uuids: tuple[str, ...]
    source: str  # "explicit", "device", "torch-current-device", "CUDA_VISIBLE_DEVICES", "nvml-all", ...

    @property
    def label(self) -> str:
        """The ``gpu_uuid`` attribute value: comma-joined UUIDs, or ``none`` / ``unknown``."""
        if self.uuids:
            return ",".join(self.uuids)
        return GPU_UNKNOWN if self.source == "unknown" else GPU_NONE


NVMLReader = Callable[[], Sequence[NVMLGPU]]


def read_nvml_gpus() -> list[NVMLGPU]:
    """Every GPU NVML sees. Raises ``NVMLMissing`` with the reason when NVML cannot be used."""
    try:
        import pynvml  # noqa: PLC0415 - optional, and only ever needed once per run
    except ImportError as exc:
        raise NVMLMissing(f"the pynvml module is not installed ({exc})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        no_driver = (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if getattr(exc, "value", None) in no_driver:
            raise NoNVIDIADriver(f"no NVIDIA driver on this machine ({exc})") from None
        raise NVMLMissing(f"NVML did not initialise ({exc})") from None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(NVMLGPU(
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                mig_uuids=_mig_uuids(pynvml, handle),
            ))
        return gpus
    except pynvml.NVMLError as exc:
        raise NVMLMissing(f"NVML could not list the GPUs ({exc})") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            log.debug("nvmlShutdown failed", exc_info=True)


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str; older pynvml releases returned bytes.
    return value.decode() if isinstance(value, bytes) else value


def _mig_uuids(pynvml: Any, handle: Any) -> tuple[str, ...]:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return ()  # not MIG capable (NotSupported) or an old driver without the call
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return ()
    uuids = []
    for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except pynvml.NVMLError:
            continue  # an unused slot (NVML_ERROR_NOT_FOUND)
        uuids.append(_text(pynvml.nvmlDeviceGetUUID(mig)))
    return tuple(uuids)


# ----------------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES


def parse_visible_devices(value: str) -> list[int] | list[str]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: a list of ordinals, or of ``GPU-``/``MIG-`` UUID (prefixes).

    The first entry decides the form; parsing stops at the first entry not of that form (or a negative
    index); a repeated entry makes the whole list empty.
    """
    text = value.strip()
    if text.startswith(("GPU-", "MIG-")):
        prefix = text[:4]
        uuids: list[str] = []
        for raw in text.split(","):
            item = raw.strip()
            if not item.startswith(prefix):
                break
            if item in uuids:
                return []
            uuids.append(item)
        return uuids
    ordinals: list[int] = []
    for raw in text.split(","):
        m = re.match(r"^\s*(-?\d+)", raw)  # strtoul-like: "1gpu" reads as 1, "x" stops
        if m is None:
            break
        ordinal = int(m.group(1))
        if ordinal < 0:
            break
        if ordinal in ordinals:
            return []
        ordinals.append(ordinal)
    return ordinals


def cuda_order(gpus: Sequence[NVMLGPU]) -> list[NVMLGPU]:
    """NVML's GPUs in CUDA ordinal order (PCI bus order; see the module docstring)."""
    return sorted(gpus, key=lambda g: g.pci_bus_id.lower())


def map_visible_devices(entries: Sequence[int] | Sequence[str], gpus: Sequence[NVMLGPU]) -> list[str]:
    """Parent GPU UUIDs for parsed CUDA_VISIBLE_DEVICES entries; stops at the first entry that names
    no GPU, as CUDA does (``0,7`` on a two-GPU node makes one GPU visible)."""
    ordered = cuda_order(gpus)
    out: list[str] = []
    for entry in entries:
        if isinstance(entry, int):
            if entry >= len(ordered):
                break
            uuid = ordered[entry].uuid
        else:
            found = match_uuid(entry, gpus)
            if found is None:
                break
            uuid = found
        if uuid not in out:
            out.append(uuid)
    return out


def match_uuid(text: str, gpus: Sequence[NVMLGPU]) -> str | None:
    """The full UUID of a ``GPU-``/``MIG-`` UUID or unique prefix (a MIG instance keeps its own; a legacy
    ``MIG-GPU-...`` id gives its parent's), or None (unknown, ambiguous)."""
    legacy = _LEGACY_MIG_RE.match(text)
    if legacy:
        text = legacy.group(1)
    needle = text.lower()
    hits = {g.uuid for g in gpus if g.uuid.lower().startswith(needle)}
    hits |= {m for g in gpus for m in g.mig_uuids if m.lower().startswith(needle)}
    return hits.pop() if len(hits) == 1 else None


def _uuid_without_nvml(text: str) -> str | None:
    """A complete GPU or MIG UUID (or legacy MIG id naming its parent) needs no NVML; prefixes do."""
    legacy = _LEGACY_MIG_RE.match(text)
    if legacy:
        text = legacy.group(1)
    if text.startswith(("GPU-", "MIG-")) and _UUID_RE.match(text[4:].lower()):
        return text
    return None


# ----------------------------------------------------------------------------------------------------
# torch (only when already imported; never initialises CUDA)


def _torch_cuda() -> Any | None:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None:
        return None
    try:
        if not cuda.is_available() or not cuda.is_initialized():
            return None
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop training
        log.debug("torch.cuda probe failed", exc_info=True)
        return None
    return cuda


def _cuda_device(device: Any) -> tuple[bool, int | None]:
    """Whether a framework device (``torch.device``, ``"cuda:1"``, an ordinal) is a CUDA device, and its
    ordinal when it names one."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True, device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        return kind == "cuda", int(idx) if idx.isdigit() else None
    if getattr(device, "type", None) != "cuda":
        return False, None
    index = getattr(device, "index", None)
    return True, index if isinstance(index, int) else None


def _torch_uuid(index: int | None) -> str | None:
    """``torch.cuda.get_device_properties(index).uuid`` as text (torch prints it without the ``GPU-`` /
    ``MIG-`` prefix NVML uses); None when torch cannot tell."""
    torch = sys.modules.get("torch")
    try:
        cuda = torch.cuda  # type: ignore[union-attr]
        if index is None:
            index = cuda.current_device()
        return str(cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - old torch without .uuid, or any CUDA error
        log.debug("torch could not tell the device UUID", exc_info=True)
        return None


def _from_torch(uuid: str, nvml_reader: NVMLReader) -> tuple[str, ...]:
    """The parent GPU UUID of a device UUID from torch. For a MIG instance CUDA reports the instance's
    UUID, which only NVML can tell from a GPU's; without NVML a bare UUID is taken to be a GPU's."""
    if uuid.startswith(("GPU-", "MIG-")):
        return tuple(_parents([uuid], nvml_reader))
    if not _UUID_RE.match(uuid.lower()):
        return ()  # not a UUID we understand: the caller moves on to the next source
    try:
        gpus: Sequence[NVMLGPU] = nvml_reader()
    except Exception:  # noqa: BLE001 - NVML is optional here: torch already answered
        gpus = []
    for candidate in ("GPU-" + uuid, "MIG-" + uuid):
        found = match_uuid(candidate, gpus)
        if found is not None:
            return (found,)
    return ("GPU-" + uuid,)


# ----------------------------------------------------------------------------------------------------
# the resolution


def resolve_gpus(
    gpu_uuids: Sequence[str] | None = None,
    *,
    device: Any = None,
    world_size: int = 1,
    environ: Mapping[str, str] | None = None,
    nvml_reader: NVMLReader = read_nvml_gpus,
) -> GPUResolution:
    """The GPUs this process uses (see the module docstring for the order). Never raises."""
    env = os.environ if environ is None else environ
    if gpu_uuids:
        return GPUResolution(tuple(_parents([str(u) for u in gpu_uuids], nvml_reader)), "explicit")

    if device is not None:
        is_cuda, index = _cuda_device(device)
        if not is_cuda:
            return GPUResolution((), "device")
        if sys.modules.get("torch") is not None:
            uuid = _torch_uuid(index)
            resolved = _from_torch(uuid, nvml_reader) if uuid else ()
            if resolved:
                return GPUResolution(resolved, "device")

    cuda = _torch_cuda()
    if cuda is not None and world_size > 1:
        uuid = _torch_uuid(None)
        resolved = _from_torch(uuid, nvml_reader) if uuid else ()
        if resolved:
            return GPUResolution(resolved, "torch-current-device")

    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _from_visible_devices(visible, env, nvml_reader)

    if cuda is not None:
        uuid = _torch_uuid(None)
        resolved = _from_torch(uuid, nvml_reader) if uuid else ()
        if resolved:
            return GPUResolution(resolved, "torch-current-device")

    gpus = _nvml(nvml_reader, no_driver_means_no_gpu=True)
    if gpus is None:
        return GPUResolution((), "unknown")
    if not gpus:
        return GPUResolution((), "nvml-all")
    if len(gpus) > 1:
        _warn_once(
            "all-gpus",
            "gpu_energy_exporter.training: this process can see %d GPUs and did not say which it uses; "
            "attributing the run to all of them. Set CUDA_VISIBLE_DEVICES or pass gpu_uuids=[...] (or "
            "start the run after moving the model to its GPU) for exact joules per token.", len(gpus),
        )
    return GPUResolution(tuple(g.uuid for g in cuda_order(gpus)), "nvml-all")


def _from_visible_devices(value: str, env: Mapping[str, str], nvml_reader: NVMLReader) -> GPUResolution:
    source = "CUDA_VISIBLE_DEVICES"
    entries = parse_visible_devices(value)
    if not entries:
        return GPUResolution((), source)  # every GPU hidden: a CPU run
    if isinstance(entries[0], str):
        # Complete GPU UUIDs (and legacy MIG ids, which embed their parent's) need no NVML.
        direct = [_uuid_without_nvml(str(e)) for e in entries]
        if all(direct):
            return GPUResolution(tuple(dict.fromkeys(d for d in direct if d)), source)
    gpus = _nvml(nvml_reader)
    if gpus is None:
        return GPUResolution((), "unknown")
    if isinstance(entries[0], int) and env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID":
        if len({g.name for g in gpus}) > 1:
            _warn_once(
                "device-order",
                "gpu_energy_exporter.training: CUDA_VISIBLE_DEVICES=%s uses indices on a node with "
                "different GPU models, where CUDA's default order (fastest first) may differ from the "
                "PCI bus order assumed here. Set CUDA_DEVICE_ORDER=PCI_BUS_ID (or use GPU UUIDs) so "
                "both agree.", value,
            )
    return GPUResolution(tuple(map_visible_devices(entries, gpus)), source)


def _parents(uuids: Sequence[str], nvml_reader: NVMLReader) -> list[str]:
    """Complete the prefixes (and map legacy MIG ids to their parent); complete GPU and MIG UUIDs pass through
    without NVML."""
    out: list[str] = []
    gpus: Sequence[NVMLGPU] | None = None
    for uuid in uuids:
        direct = _uuid_without_nvml(uuid)
        if direct is None:
            if gpus is None:
                gpus = _nvml(nvml_reader) or []
            direct = match_uuid(uuid, gpus)
        if direct is None:
            # Keep what we were given: a MIG UUID still identifies the device for a human.
            _warn_once("unmapped:" + uuid,
                       "gpu_energy_exporter.training: cannot map %s to a GPU UUID; using it as is.", uuid)
            direct = uuid
        if direct not in out:
            out.append(direct)
    return out


def _nvml(nvml_reader: NVMLReader, no_driver_means_no_gpu: bool = False) -> Sequence[NVMLGPU] | None:
    """The GPUs NVML lists, or None (with one warning per process) when NVML cannot be used. With
    ``no_driver_means_no_gpu``, a machine without an NVIDIA driver has no GPUs (``[]``, no warning): a run
    that named no GPU there is a CPU run, ``gpu_uuid="none"``, as the docs say."""
    try:
        return nvml_reader()
    except NVMLMissing as exc:
        if no_driver_means_no_gpu and isinstance(exc, NoNVIDIADriver):
            log.debug("no GPUs: %s", exc)
            return []
        _warn_once(
            "nvml",
            "gpu_energy_exporter.training: cannot tell which GPUs this process uses: %s. Training "
            "continues; its points carry gpu_uuid=\"unknown\" unless you pass gpu_uuids=[...] or set "
            "CUDA_VISIBLE_DEVICES to GPU UUIDs.", exc,
        )
        return None
    except Exception:  # noqa: BLE001 - never let a driver problem stop training
        _warn_once("nvml-error", "gpu_energy_exporter.training: NVML failed while listing GPUs",
                   exc_info=True)
        return None
