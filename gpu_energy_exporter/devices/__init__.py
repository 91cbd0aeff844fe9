"""Device backends: where GPU readings come from (real NVML, or simulated GPUs for ``demo``)."""
