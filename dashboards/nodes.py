"""The fleet overview and node-detail dashboards: power, energy, CO2 and utilisation of every GPU the
exporters see, where the energy goes, and one node's GPUs in detail.

Exporter series names are those of the exporter's metric catalogue (tests/test_dashboards.py checks each
against ``dashboards/names.py``). Plain data: this module never imports grafana-foundation-sdk.
"""

from __future__ import annotations

from dashboards.spec import (
    BYTES,
    CELSIUS,
    COUNT,
    DATASOURCE_VAR,
    FLEET,
    FLEET_NODE_VAR,
    GPU_LEGEND,
    GPU_VAR,
    GRAM,
    GRAMS_PER_HOUR,
    HERTZ,
    JOB_VAR,
    JOULE,
    KWH,
    NODE,
    NODE_GPU,
    NODE_VAR,
    ON_OFF,
    RATIO,
    RUN_LEGEND,
    SECONDS,
    WATT,
    Dashboard,
    Panel,
    Query,
    Row,
    ledger_sum,
    sel,
)
from gpu_energy_exporter.core.contract import ATTR_RUN_ID

#: Grafana's unit for bytes per second (the GPU health row's throughput panel).
BYTES_PER_SECOND = "Bps"

# ---------------------------------------------------------------------------------------------------------
# Fleet overview

FLEET_DASHBOARD = Dashboard(
    name="fleet-overview",
    uid="gpuenergy-fleet-overview",
    title="GPU energy / Fleet overview",
    description="Power, energy, CO2 and utilisation of every GPU the exporters see; where the energy goes.",
    variables=(DATASOURCE_VAR, JOB_VAR, FLEET_NODE_VAR),
    rows=(
        Row("Now", (
            Panel("stat", "GPU power now",
                  "Total power of the selected nodes' GPUs over the last 5 minutes, from the GPU energy "
                  "counters (recording rule instance_gpu:gpuenergy_gpu_energy_joules:rate5m), each GPU "
                  "counted once by its UUID even when two scrape targets serve it.",
                  WATT, (Query("sum(max by (gpu_uuid) "
                               f"({sel('instance_gpu:gpuenergy_gpu_energy_joules:rate5m', FLEET)}))"),),
                  width=4, height=4),
            Panel("stat", "GPU energy today",
                  "Energy used by the selected nodes' GPUs since midnight (dashboard time zone), from the "
                  "energy counters, each GPU counted once by its UUID.",
                  KWH, (Query(f"sum(max by (gpu_uuid) (increase({sel('gpuenergy_gpu_energy_joules_total', FLEET)}"
                              "[$__range]))) / 3.6e6"),),
                  width=4, height=4, time_from="now/d"),
            Panel("stat", "GPU CO2 today",
                  "CO2-equivalent of the GPU energy since midnight: the increase of the exporters' CO2 "
                  "counters (gpuenergy_gpu_co2_grams_total: every sampling interval's energy x PUE x the grid "
                  "intensity in force then, so a grid intensity that changes during the day is weighted as "
                  "it happened), each GPU counted once by its UUID.",
                  GRAM, (Query(f"sum(max by (gpu_uuid) (increase({sel('gpuenergy_gpu_co2_grams_total', FLEET)}"
                               "[$__range])))"),),
                  width=4, height=4, time_from="now/d"),
            Panel("stat", "GPUs answering",
                  "GPUs whose last NVML sample succeeded (gpuenergy_gpu_up 1), each counted once by its UUID.",
                  COUNT, (Query(f"count(max by (gpu_uuid) ({sel('gpuenergy_gpu_up', FLEET)}) == 1) or vector(0)"),),
                  width=4, height=4),
            Panel("stat", "Exporters down",
                  "Exporter targets Prometheus failed to scrape at its last attempt (up 0). The list is in "
                  "the table at the bottom.",
                  COUNT, (Query(f"count({sel('up', FLEET)} == 0) or vector(0)"),),
                  width=4, height=4, thresholds=((1, "red"),)),
            Panel("stat", "GPUs lost / NVML unavailable",
                  "GPUs that stopped answering NVML (gpuenergy_gpu_up 0, each GPU once by its UUID) and "
                  "exporters that cannot use NVML at all (gpuenergy_nvml_available 0; see its reason label on "
                  "the node dashboard).",
                  COUNT, (Query(f"count(max by (gpu_uuid) ({sel('gpuenergy_gpu_up', FLEET)}) == 0) or vector(0)",
                                "GPUs lost"),
                          Query(f"count({sel('gpuenergy_nvml_available', FLEET)} == 0) or vector(0)",
                                "NVML unavailable")),
                  width=4, height=4, thresholds=((1, "red"),)),
        )),
        Row("Power, utilisation and carbon by node", (
            Panel("timeseries", "GPU power by node",
                  "Power of each node's GPUs together, from the energy counters over 5 minutes.",
                  WATT, (Query(sel("instance:gpuenergy_gpu_energy_joules:rate5m", FLEET), "{{instance}}"),)),
            Panel("timeseries", "GPU utilisation by node",
                  "Mean time-active utilisation of each node's GPUs (the fraction of time a kernel ran; "
                  "not how many SMs it kept busy).",
                  RATIO, (Query(f"avg by (instance) ({sel('gpuenergy_gpu_utilization_ratio', FLEET)})",
                                "{{instance}}"),),
                  minimum=0, maximum=1),
            Panel("timeseries", "GPU CO2 rate by node",
                  "Grams of CO2-equivalent per hour caused by each node's GPUs: the rate of the exporters' CO2 "
                  "counters, each interval's energy x PUE x the grid intensity then (recording rule "
                  "instance:gpuenergy_gpu_co2_grams:rate5m x 3600).",
                  GRAMS_PER_HOUR, (Query(f"{sel('instance:gpuenergy_gpu_co2_grams:rate5m', FLEET)} * 3600",
                                         "{{instance}}"),)),
            Panel("bargauge", "GPU energy by node (selected range)",
                  "Energy each node's GPUs used over the dashboard's time range.",
                  KWH, (Query("sort_desc(sum by (instance) "
                              f"(increase({sel('gpuenergy_gpu_energy_joules_total', FLEET)}[$__range])) / 3.6e6)",
                              "{{instance}}"),)),
        )),
        Row("Where the energy goes", (
            Panel("bargauge", "GPUs by utilisation (average over the range)",
                  "Every selected GPU's mean time-active utilisation over the dashboard range, busiest "
                  "first: the bottom of the list is idle hardware still drawing idle power.",
                  RATIO, (Query("sort_desc(avg_over_time("
                                f"{sel('gpuenergy_gpu_utilization_ratio', FLEET)}[$__range]))", GPU_LEGEND),),
                  width=8, height=10, minimum=0, maximum=1),
            Panel("bargauge", "Top runs by GPU energy (selected range)",
                  "The ten training runs whose GPUs used the most energy within the dashboard range: the "
                  "increase of the run ledgers' energy counters (gpuenergy_run_energy_joules_total, summed "
                  "over nodes), which start with the run and split a GPU shared by several runs, so each "
                  "joule is charged once and none from before the run. Fallback, for runs no ledger covers "
                  "completely (training data through another OTLP path, or a multi-node run whose ranks "
                  "all push to one exporter): the recorded run power (run_id:gpuenergy_gpu_energy_joules:"
                  "rate5m) summed minute by minute, which lags the run's start by the 5-minute window and "
                  "charges a shared GPU's whole energy to each run on it. Runs span nodes, so the node "
                  "filter does not apply.",
                  JOULE, (Query(f"topk(10, {ledger_sum('increase(gpuenergy_run_energy_joules_total[$__range])')}"
                                f" and on ({ATTR_RUN_ID}) max_over_time("
                                "run_id:gpuenergy_run_energy_joules:ledger_complete[$__range])"
                                " or sum_over_time(run_id:gpuenergy_gpu_energy_joules:rate5m[$__range:1m]) * 60)",
                                RUN_LEGEND),),
                  width=8, height=10),
            Panel("bargauge", "Top namespaces by GPU energy (selected range)",
                  "The ten Kubernetes namespaces whose pods' GPUs used the most energy within the range "
                  "(needs --collector.kubernetes; empty elsewhere).",
                  JOULE, (Query("topk(10, sum by (k8s_namespace) (increase("
                                f"{sel('gpuenergy_k8s_pod_energy_joules_total', FLEET)}[$__range])))",
                                "{{k8s_namespace}}"),),
                  width=8, height=10),
            Panel("table", "Exporters down",
                  "Exporter targets whose last scrape failed: the node's GPU energy is not being recorded.",
                  COUNT, (Query(f"{sel('up', FLEET)} == 0", "{{instance}}"),),
                  width=24, height=6),
        )),
    ),
)

# ---------------------------------------------------------------------------------------------------------
# Node and GPU detail

NODE_DASHBOARD = Dashboard(
    name="node-detail",
    uid="gpuenergy-node-detail",
    title="GPU energy / Node and GPU detail",
    description="Everything the exporter measures on one node: GPU power three ways, energy, memory, "
                "utilisation, GPM activity, temperatures, clocks and throttling, host CPU, RAM and RAPL.",
    variables=(DATASOURCE_VAR, JOB_VAR, NODE_VAR, GPU_VAR),
    rows=(
        Row("Power and energy", (
            Panel("timeseries", "GPU power: instant, 1 s average and from the energy counter",
                  "Instant power (NVML's instant field; on A100/H100 it sees ~25 ms of every 100 ms), the "
                  "driver's 1 s average, and the rate of the energy counter (exact over the interval, the "
                  "one to trust for energy), with the enforced power limit, the idle baseline the exporter "
                  "learned or was given, and on Grace Hopper the module power (GPU + Grace CPU + memory; "
                  "it includes the GPU: never add the two).",
                  WATT, (
                      Query(sel("gpuenergy_gpu_power_watts", NODE_GPU), f"{GPU_LEGEND} instant"),
                      Query(sel("gpuenergy_gpu_power_average_watts", NODE_GPU), f"{GPU_LEGEND} 1 s average"),
                      Query(f"rate({sel('gpuenergy_gpu_energy_joules_total', NODE_GPU)}[$__rate_interval])",
                            f"{GPU_LEGEND} energy counter"),
                      Query(sel("gpuenergy_gpu_power_limit_watts", NODE_GPU), f"{GPU_LEGEND} limit"),
                      Query(sel("gpuenergy_gpu_idle_power_watts", NODE_GPU),
                            f"{GPU_LEGEND} idle baseline ({{{{source}}}})"),
                      Query(sel("gpuenergy_gpu_module_power_watts", NODE_GPU), f"{GPU_LEGEND} module"),
                  ),
                  width=24, height=9),
            Panel("stat", "GPU energy (selected range)",
                  "Energy each GPU used over the dashboard range, from its energy counter.",
                  KWH, (Query(f"increase({sel('gpuenergy_gpu_energy_joules_total', NODE_GPU)}[$__range])"
                              " / 3.6e6", GPU_LEGEND),),
                  width=8),
            Panel("timeseries", "GPU energy counter",
                  "The exposed energy counter: NVML's counter (since driver load) kept monotonic across "
                  "driver reloads, or integrated instant power on GPUs without one (see energy_method in "
                  "gpuenergy_gpu_info).",
                  JOULE, (Query(sel("gpuenergy_gpu_energy_joules_total", NODE_GPU), GPU_LEGEND),),
                  width=16),
        )),
        Row("Memory and utilisation", (
            Panel("timeseries", "VRAM",
                  "Framebuffer memory in use (all processes), reserved by the driver, and the total.",
                  BYTES, (
                      Query(sel("gpuenergy_gpu_memory_used_bytes", NODE_GPU), f"{GPU_LEGEND} used"),
                      Query(sel("gpuenergy_gpu_memory_reserved_bytes", NODE_GPU), f"{GPU_LEGEND} reserved"),
                      Query(sel("gpuenergy_gpu_memory_total_bytes", NODE_GPU), f"{GPU_LEGEND} total"),
                  ),
                  width=16),
            Panel("bargauge", "VRAM in use",
                  "Used / total framebuffer memory now. The GPUMemoryAlmostFull alert fires above 95% for "
                  "5 minutes.",
                  RATIO, (Query(f"{sel('gpuenergy_gpu_memory_used_bytes', NODE_GPU)}"
                                f" / {sel('gpuenergy_gpu_memory_total_bytes', NODE_GPU)}", GPU_LEGEND),),
                  width=8, minimum=0, maximum=1, thresholds=((0.8, "orange"), (0.95, "red"))),
            Panel("timeseries", "Utilisation: time-active and memory controller",
                  "NVML utilisation: the fraction of the sample period in which any kernel ran (a GPU "
                  "running one tiny kernel all the time shows 100%), and the fraction the memory controller "
                  "was busy.",
                  RATIO, (
                      Query(sel("gpuenergy_gpu_utilization_ratio", NODE_GPU), f"{GPU_LEGEND} time-active"),
                      Query(sel("gpuenergy_gpu_memory_utilization_ratio", NODE_GPU),
                            f"{GPU_LEGEND} memory controller"),
                  ),
                  minimum=0, maximum=1),
            Panel("timeseries", "SM, tensor and DRAM activity (GPM)",
                  "NVML GPM metrics (Hopper and newer; empty on older GPUs and vGPU): fraction of SMs busy, "
                  "resident warps against the maximum, time the tensor cores issued work, graphics/compute "
                  "engine activity, and DRAM bandwidth against its peak.",
                  RATIO, (
                      Query(sel("gpuenergy_gpu_sm_active_ratio", NODE_GPU), f"{GPU_LEGEND} SM active"),
                      Query(sel("gpuenergy_gpu_sm_occupancy_ratio", NODE_GPU), f"{GPU_LEGEND} SM occupancy"),
                      Query(sel("gpuenergy_gpu_tensor_active_ratio", NODE_GPU), f"{GPU_LEGEND} tensor active"),
                      Query(sel("gpuenergy_gpu_graphics_active_ratio", NODE_GPU),
                            f"{GPU_LEGEND} graphics/compute active"),
                      Query(sel("gpuenergy_gpu_dram_bandwidth_utilization_ratio", NODE_GPU),
                            f"{GPU_LEGEND} DRAM bandwidth"),
                  ),
                  minimum=0, maximum=1),
        )),
        Row("Thermals, clocks and throttling", (
            Panel("timeseries", "Temperature",
                  "GPU die and HBM memory temperature. GPUTemperatureHigh fires above 85 °C for 5 minutes.",
                  CELSIUS, (
                      Query(sel("gpuenergy_gpu_temperature_celsius", NODE_GPU), f"{GPU_LEGEND} die"),
                      Query(sel("gpuenergy_gpu_memory_temperature_celsius", NODE_GPU), f"{GPU_LEGEND} memory"),
                  ),
                  width=8, thresholds=((85, "red"),)),
            Panel("timeseries", "Clocks",
                  "Current SM and memory clocks; a drop under load with a throttle reason active on the "
                  "right means the GPU is being slowed.",
                  HERTZ, (
                      Query(sel("gpuenergy_gpu_sm_clock_hertz", NODE_GPU), f"{GPU_LEGEND} SM"),
                      Query(sel("gpuenergy_gpu_memory_clock_hertz", NODE_GPU), f"{GPU_LEGEND} memory"),
                  ),
                  width=8),
            Panel("statetimeline", "Throttle reasons (clock events)",
                  "When each NVML clock-event reason was active (only reasons active at some point are "
                  "shown). Thermal reasons mean cooling trouble; hw_power_brake_slowdown an external power "
                  "brake; sw_power_cap running at the power limit (normal at full load).",
                  ON_OFF, (Query(f"{sel('gpuenergy_gpu_clock_event_active', NODE_GPU)} == 1",
                                 f"{GPU_LEGEND} {{{{reason}}}}"),),
                  width=8),
        )),
        Row("GPU health", (
            Panel("timeseries", "Xid errors",
                  "Xid errors the driver reported, by code, over each interval (collector health). 79: fell off "
                  "the bus; 74: NVLink; 48, 94, 95: uncorrectable memory errors: GPUXidCritical fires, drain "
                  "and reset. 13, 31, 43 are usually the application. Empty where Xid events are not watched "
                  "(see the panel on the right).",
                  COUNT, (Query(f"increase({sel('gpuenergy_gpu_xid_errors_total', NODE_GPU)}[$__rate_interval]) > 0",
                                f"{GPU_LEGEND} Xid {{{{xid}}}}"),),
                  width=8),
            Panel("timeseries", "Memory errors and repairs",
                  "ECC error counts (volatile: since the driver loaded; aggregate: the GPU's lifetime), rows "
                  "remapped (Ampere and newer) and pages retired (before). A rising uncorrected count fires "
                  "GPUUncorrectableECCError.",
                  COUNT, (
                      Query(sel("gpuenergy_gpu_ecc_errors_total", NODE_GPU),
                            f"{GPU_LEGEND} ECC {{{{error_type}}}} ({{{{counter}}}})"),
                      Query(sel("gpuenergy_gpu_remapped_rows_total", NODE_GPU),
                            f"{GPU_LEGEND} remapped rows ({{{{cause}}}})"),
                      Query(sel("gpuenergy_gpu_retired_pages", NODE_GPU),
                            f"{GPU_LEGEND} retired pages ({{{{cause}}}})"),
                  ),
                  width=8),
            Panel("statetimeline", "Repairs pending, Xid events watched",
                  "A row remap or page retirement waiting for a GPU reset (drain, then reset: "
                  "GPUMemoryRepairPending), a failed remap (RMA: GPURowRemapFailed), and whether the exporter "
                  "receives the GPU's Xid events at all (off on vGPU and older drivers).",
                  ON_OFF, (
                      Query(sel("gpuenergy_gpu_row_remap_pending", NODE_GPU), f"{GPU_LEGEND} row remap pending"),
                      Query(sel("gpuenergy_gpu_retired_pages_pending", NODE_GPU),
                            f"{GPU_LEGEND} page retirement pending"),
                      Query(sel("gpuenergy_gpu_row_remap_failure", NODE_GPU), f"{GPU_LEGEND} row remap failed"),
                      Query(sel("gpuenergy_gpu_xid_events_watched", NODE_GPU), f"{GPU_LEGEND} Xid events watched"),
                  ),
                  width=8),
            Panel("timeseries", "PCIe link against its maximum",
                  "Current PCIe link generation and width (lanes) next to the most the GPU and slot support. "
                  "A narrower link is a fault (reseat the card); a lower generation is normal at idle. "
                  "GPUPCIeLinkDegraded fires after 15 minutes.",
                  COUNT, (
                      Query(sel("gpuenergy_gpu_pcie_link_generation", NODE_GPU), f"{GPU_LEGEND} generation"),
                      Query(sel("gpuenergy_gpu_pcie_link_max_generation", NODE_GPU), f"{GPU_LEGEND} max generation"),
                      Query(sel("gpuenergy_gpu_pcie_link_width", NODE_GPU), f"{GPU_LEGEND} width"),
                      Query(sel("gpuenergy_gpu_pcie_link_max_width", NODE_GPU), f"{GPU_LEGEND} max width"),
                  ),
                  width=8),
            Panel("timeseries", "PCIe and NVLink throughput",
                  "PCIe throughput as the driver measured it at the last health read (every "
                  "--collector.health.interval), and NVLink payload throughput summed over the GPU's links.",
                  BYTES_PER_SECOND, (
                      Query(sel("gpuenergy_gpu_pcie_throughput_bytes_per_second", NODE_GPU),
                            f"{GPU_LEGEND} PCIe {{{{direction}}}}"),
                      Query("sum by (instance, gpu, direction) (rate("
                            f"{sel('gpuenergy_gpu_nvlink_data_bytes_total', NODE_GPU)}[$__rate_interval]))",
                            f"{GPU_LEGEND} NVLink {{{{direction}}}}"),
                  ),
                  width=8),
            Panel("timeseries", "PCIe replays, NVLink errors and links up",
                  "PCIe replays (link-level retransmissions) and NVLink errors per interval, and the number "
                  "of NVLink links up: replays or CRC errors that keep rising point at a marginal link.",
                  COUNT, (
                      Query(f"increase({sel('gpuenergy_gpu_pcie_replays_total', NODE_GPU)}[$__rate_interval])",
                            f"{GPU_LEGEND} PCIe replays"),
                      Query("sum by (instance, gpu, error) (increase("
                            f"{sel('gpuenergy_gpu_nvlink_errors_total', NODE_GPU)}[$__rate_interval]))",
                            f"{GPU_LEGEND} NVLink {{{{error}}}} errors"),
                      Query(f"sum by (instance, gpu) ({sel('gpuenergy_gpu_nvlink_up', NODE_GPU)})",
                            f"{GPU_LEGEND} NVLink links up"),
                  ),
                  width=8),
        )),
        Row("Host", (
            Panel("timeseries", "Host CPU utilisation",
                  "Fraction of all logical CPUs' time spent busy: data loading and tokenisation live here.",
                  RATIO, (Query(sel("gpuenergy_host_cpu_utilization_ratio", NODE), "{{instance}}"),),
                  width=8, minimum=0, maximum=1),
            Panel("timeseries", "Host memory",
                  "Physical RAM: total, available (what can be allocated without swapping), used, and the "
                  "critical threshold (--host.memory-critical, default 1 GiB) under which HostMemoryCritical "
                  "fires.",
                  BYTES, (
                      Query(sel("gpuenergy_host_memory_total_bytes", NODE), "{{instance}} total"),
                      Query(sel("gpuenergy_host_memory_available_bytes", NODE), "{{instance}} available"),
                      Query(sel("gpuenergy_host_memory_used_bytes", NODE), "{{instance}} used"),
                      Query(sel("gpuenergy_host_memory_critical_bytes", NODE), "{{instance}} critical threshold"),
                  ),
                  width=8),
            Panel("timeseries", "CPU and DRAM power (RAPL)",
                  "Power of each RAPL zone from its energy counter. Zones overlap: core and uncore "
                  "(scope package_part) are inside their package, psys (scope platform) covers everything; "
                  "CPU + memory power is the sum of scope package and scope dram only. Needs read access "
                  "to energy_uj (root, or see docs).",
                  WATT, (Query(f"rate({sel('gpuenergy_rapl_energy_joules_total', NODE)}[$__rate_interval])",
                               "{{instance}} package {{package}} {{domain}} ({{scope}})"),),
                  width=8),
        )),
        Row("Exporter health", (
            Panel("statetimeline", "NVML and collectors",
                  "Whether NVML is usable (with the reason when not) and whether each collector's last "
                  "update succeeded (a collector with nothing to read, such as RAPL without permission, "
                  "shows as off).",
                  ON_OFF, (
                      Query(sel("gpuenergy_nvml_available", NODE), "{{instance}} NVML {{reason}}"),
                      Query(sel("gpuenergy_collector_success", NODE), "{{instance}} collector {{collector}}"),
                  ),
                  width=16),
            Panel("timeseries", "Age of the last good GPU sample",
                  "Seconds since each GPU last answered; it grows while a GPU is lost or the sampler is "
                  "stuck in a hung driver call.",
                  SECONDS, (Query(sel("gpuenergy_gpu_last_sample_age_seconds", NODE_GPU), GPU_LEGEND),),
                  width=8),
        )),
    ),
)
