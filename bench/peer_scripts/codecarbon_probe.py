"""Runs inside the CodeCarbon venv (bench/peer_envs.py): an OfflineEmissionsTracker on one fake GPU, from
unix time --start to --end, with its default settings (measure_power_secs=15) and no network.

The GPU energy-counter reads are timestamped (a wrapper around CodeCarbon's own read, which it still
performs) so the caller can compare with the true energy between the first and the last read. Prints one
JSON line. Imports only CodeCarbon and the standard library; CodeCarbon decides whether a machine has NVIDIA
GPUs by running ``nvidia-smi``, so the caller puts a stub ``nvidia-smi`` on PATH.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpu", type=int, required=True)
    p.add_argument("--start", type=float, required=True)
    p.add_argument("--end", type=float, required=True)
    p.add_argument("--country", default="FRA")
    args = p.parse_args()

    import codecarbon
    from codecarbon import OfflineEmissionsTracker
    from codecarbon.core import gpu_nvidia

    reads: list[float] = []
    original = gpu_nvidia.NvidiaGPUDevice._get_total_energy_consumption

    def timed(self: Any) -> Any:
        t0 = time.time()
        value = original(self)
        reads.append((t0 + time.time()) / 2)
        return value

    gpu_nvidia.NvidiaGPUDevice._get_total_energy_consumption = timed
    tracker = OfflineEmissionsTracker(country_iso_code=args.country, gpu_ids=[args.gpu], log_level="error",
                                      save_to_file=False)
    delay = args.start - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.time()
    tracker.start()
    start_s = time.time() - t0
    first_read = len(reads)
    delay = args.end - time.time()
    if delay > 0:
        time.sleep(delay)
    t1 = time.time()
    tracker.stop()
    stop_s = time.time() - t1
    data = tracker.final_emissions_data
    window_reads = reads[max(0, first_read - 1):]
    print("RESULT " + json.dumps({
        "energy_j": data.gpu_energy * 3.6e6, "first_read": window_reads[0], "last_read": window_reads[-1],
        "reads": len(window_reads), "start_call_s": start_s, "stop_call_s": stop_s,
        "version": codecarbon.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
