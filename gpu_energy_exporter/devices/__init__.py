"""Device backends: where GPU readings come from (real NVML, or simulated GPUs for ``demo``). Vendor units stop
here: readings leave in base units (``core.state.GPUReading``). Imports only ``core``."""
