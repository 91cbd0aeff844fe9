"""Rank, world size and a run id shared by every rank of a distributed training run.

Rank and world size come from ``torch.distributed`` when it is initialised, else from the ``RANK`` /
``WORLD_SIZE`` variables that ``torchrun``, ``accelerate launch`` and ``deepspeed`` set, else 0 and 1.

Every rank of a run must carry the same ``run_id`` or the exporter sees N unrelated runs. Without an
explicit ``run_id`` (or ``GPU_ENERGY_RUN_ID``), a multi-rank run agrees on one: rank 0 generates it and
broadcasts it over the initialised process group (so ``start_run`` is then a collective call: call it on
every rank), else a launcher's job id that every rank sees (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``).

This module never imports torch (it uses it only when the training script already did) and never
initialises a process group or a CUDA context.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("gpu_energy_exporter.training")

#: Environment variable naming the run id explicitly (the same value on every rank).
RUN_ID_ENV = "GPU_ENERGY_RUN_ID"


def _initialised_dist() -> Any | None:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # noqa: BLE001 - a half-installed torch must not stop training
        log.debug("torch.distributed probe failed", exc_info=True)
    return None


def rank_and_world_size(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(global rank, world size) of this process."""
    dist = _initialised_dist()
    if dist is not None:
        return int(dist.get_rank()), int(dist.get_world_size())
    env = os.environ if environ is None else environ
    try:
        rank = int(env.get("RANK", "0"))
        world_size = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        log.warning("gpu_energy_exporter.training: RANK=%r / WORLD_SIZE=%r are not integers; assuming a "
                    "single process", env.get("RANK"), env.get("WORLD_SIZE"))
        return 0, 1
    return max(rank, 0), max(world_size, 1)


def new_run_id() -> str:
    """A readable, sortable, unique run id: ``20250131-142530-3f9a1c``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def shared_run_id(run_id: str | None, world_size: int, environ: Mapping[str, str] | None = None) -> str:
    """The run id every rank of this run agrees on (see the module docstring)."""
    if run_id:
        return str(run_id)
    env = os.environ if environ is None else environ
    if env.get(RUN_ID_ENV):
        return env[RUN_ID_ENV]
    if world_size <= 1:
        return new_run_id()
    dist = _initialised_dist()
    if dist is not None and _broadcast_is_safe(dist):
        box = [new_run_id() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":  # torchrun's placeholder when no --rdzv-id was given
        return "elastic-" + elastic
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return "slurm-" + env["SLURM_JOB_ID"] + (f".{step}" if step else "")
    log.warning(
        "gpu_energy_exporter.training: %d ranks but no shared run id: each rank reports its own run. "
        "Pass run_id=... (the same on every rank), set %s, or start the run after "
        "torch.distributed.init_process_group.", world_size, RUN_ID_ENV,
    )
    return new_run_id()


def _broadcast_is_safe(dist: Any) -> bool:
    # broadcast_object_list over NCCL goes through torch.cuda.current_device(): before the script has
    # picked its GPU that is cuda:0 on every rank, which creates stray contexts on GPU 0 and can make NCCL
    # fail on duplicate GPUs. Only broadcast over NCCL once CUDA is in use.
    try:
        backend = str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001
        return False
    if "nccl" not in backend:
        return True
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False
