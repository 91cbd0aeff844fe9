"""A fake ``libnvidia-ml.so.1`` for running the exporter's real NVML code path in tests.

``build_library(out_dir)`` compiles fakenvml.c; a scenario file (``Scenario(...).write(path)``, its path in
the environment variable ``FAKE_NVML_SCENARIO``) scripts the GPUs. The exporter loads the library exactly as
it loads the driver's: ``--nvml.library PATH`` makes it set ``pynvml.nvmlLib = ctypes.CDLL(PATH)`` under
``pynvml.libLoadLock`` before ``nvmlInit()`` (or, with no flag, pynvml's own ``CDLL("libnvidia-ml.so.1")``
finds it through ``LD_LIBRARY_PATH``). No ``load_into_pynvml`` helper exists on purpose: tests go through the
production loading code. This package must never import pynvml or load the library itself.
"""

from __future__ import annotations

from .build import LIBRARY_NAME, CompilerNotFound, build_library, exported_functions
from .scenario import (
    ARCH_AMPERE,
    ARCH_HOPPER,
    ARCH_PASCAL,
    ARCH_VOLTA,
    GPM_ANY_TENSOR_UTIL,
    GPM_DRAM_BW_UTIL,
    GPM_GRAPHICS_UTIL,
    GPM_SM_OCCUPANCY,
    GPM_SM_UTIL,
    GPU,
    IDLE_GPM,
    POWER_SCOPE_GPU,
    POWER_SCOPE_MODULE,
    Constant,
    Driver,
    EnergyFault,
    PowerTrace,
    Process,
    Scenario,
    Square,
    Steps,
    a100,
    bad_reading,
    energy_jump,
    energy_unreadable,
    gpu_uuid,
    grace_hopper,
    h100,
    mig_uuids,
    pascal_no_counter,
    to_mw,
    v100,
)

#: Environment variable holding the scenario file's path.
SCENARIO_ENV = "FAKE_NVML_SCENARIO"
#: Environment variable naming the cost model's profile (wins over the scenario's ``Driver.cost_profile``;
#: "off" disables it): every NVML call then burns the CPU time that real driver was measured to burn.
COST_PROFILE_ENV = "FAKE_NVML_COST_PROFILE"
#: Cost profiles the library knows, named for the card and driver they were measured on
#: (reference/real-gpu-h100.md). The benchmarks use the first by default.
COST_PROFILES = ("h100-580",)
#: Environment variable: if set, the library appends "<unix time> <pid> <function>" per NVML call to it.
CALL_LOG_ENV = "FAKE_NVML_CALL_LOG"

__all__ = [
    "ARCH_AMPERE",
    "ARCH_HOPPER",
    "ARCH_PASCAL",
    "ARCH_VOLTA",
    "CALL_LOG_ENV",
    "COST_PROFILES",
    "COST_PROFILE_ENV",
    "GPM_ANY_TENSOR_UTIL",
    "GPM_DRAM_BW_UTIL",
    "GPM_GRAPHICS_UTIL",
    "GPM_SM_OCCUPANCY",
    "GPM_SM_UTIL",
    "GPU",
    "IDLE_GPM",
    "LIBRARY_NAME",
    "POWER_SCOPE_GPU",
    "POWER_SCOPE_MODULE",
    "SCENARIO_ENV",
    "CompilerNotFound",
    "Constant",
    "Driver",
    "EnergyFault",
    "PowerTrace",
    "Process",
    "Scenario",
    "Square",
    "Steps",
    "a100",
    "bad_reading",
    "build_library",
    "energy_jump",
    "energy_unreadable",
    "exported_functions",
    "gpu_uuid",
    "grace_hopper",
    "h100",
    "mig_uuids",
    "pascal_no_counter",
    "to_mw",
    "v100",
]
