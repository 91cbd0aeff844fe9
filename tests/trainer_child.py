"""A training process for the attribution tests: the real helper (``start_run``) in its own process, so that
the fake NVML can list its real pid on a GPU. Plain loop, no torch (it starts in a fraction of a second).

    python tests/trainer_child.py ENDPOINT RUN_ID GPU_UUIDS SECONDS TOKENS_PER_STEP [WORLD_SIZE RANK]

With ``TRAINER_GO_FILE`` set, waits for that file before starting the run. Prints ``started`` once its
run is started and ``finished`` after ``run.finish()`` returned.
"""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> int:
    from gpu_energy_exporter.training import start_run

    endpoint, run_id, gpus, seconds, tokens = argv[:5]
    world = int(argv[5]) if len(argv) > 5 else 1
    rank = int(argv[6]) if len(argv) > 6 else 0
    go = os.environ.get("TRAINER_GO_FILE")
    if go:  # wait until the test made the fake NVML list this process
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
    flops = float(os.environ.get("TRAINER_FLOPS_PER_STEP", "0"))
    # GPU_UUIDS "-": the helper finds them itself (CUDA_VISIBLE_DEVICES, NVML), as a real trainer does
    run = start_run(run_id, endpoint=endpoint, export_interval=0.3, gpu_uuids=None if gpus == "-" else gpus.split(","),
                    world_size=world, rank=rank, model="tiny", precision="bf16")
    print("started", flush=True)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        run.step(tokens=int(tokens), samples=1, flops=flops)
        time.sleep(0.05)
    run.finish()
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
