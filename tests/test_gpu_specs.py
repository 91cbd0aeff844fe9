"""Peak FLOP/s rows matched against the product names NVML really returns (issue 10, part of 9).

One table of names as drivers report them, each with the row it must match or None where the table has no
figure for that product (a wrong denominator is worse than no MFU). The names are spelled as nvidia-smi and
NVML print them; variants of one product (memory size, SXM generation spelled or not, "NVIDIA" prefix or
none, odd spacing) must land on the same row.
"""

from __future__ import annotations

import pytest

from gpu_energy_exporter.reference.gpu_specs import lookup_peak_flops

NAMES: list[tuple[str, str | None]] = [
    # Hopper
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
    ("NVIDIA H200", "NVIDIA H200 SXM"),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
    ("NVIDIA GH200 480GB", "NVIDIA GH200 (Hopper GPU)"),
    ("NVIDIA GH200 144G HBM3e", "NVIDIA GH200 (Hopper GPU)"),
    ("NVIDIA H800", None),  # export variant: different interconnect, no datasheet figure in the table
    ("NVIDIA H20", None),
    # Ampere
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM4 40GB/80GB"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 SXM4 40GB/80GB"),
    ("NVIDIA A100-SXM-80GB", "NVIDIA A100 SXM4 40GB/80GB"),  # DGX A100 80GB boards report no "4"
    ("A100-SXM-80GB", "NVIDIA A100 SXM4 40GB/80GB"),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100 PCIe 40GB/80GB"),
    ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 PCIe 40GB/80GB"),
    ("NVIDIA A800-SXM4-80GB", None),
    ("NVIDIA A30", None),
    ("NVIDIA A40", None),
    ("NVIDIA A10G", "NVIDIA A10G"),  # a row with no figures: matched, and no MFU
    # Ada
    ("NVIDIA L40S", "NVIDIA L40S"),
    ("NVIDIA L40", None),
    ("NVIDIA L4", "NVIDIA L4"),
    ("NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX 6000 Ada Generation"),
    ("NVIDIA RTX  6000  Ada Generation", "NVIDIA RTX 6000 Ada Generation"),  # doubled spaces
    ("Quadro RTX 6000", None),
    # Volta
    ("Tesla V100-SXM2-32GB", "Tesla V100 SXM2"),
    ("Tesla V100-SXM2-16GB", "Tesla V100 SXM2"),
    ("Tesla V100-PCIE-32GB", "Tesla V100 PCIe"),
    ("Tesla V100S-PCIE-32GB", "Tesla V100S PCIe"),
    ("Tesla V100-SXM3-32GB", None),  # DGX-2's SXM3 part is not in the table
    # Blackwell
    ("NVIDIA B200", "NVIDIA B200 (HGX)"),
    ("NVIDIA GB200", None),
]


@pytest.mark.parametrize(("nvml_name", "model"), NAMES)
def test_nvml_product_names_match_their_row(nvml_name: str, model: str | None) -> None:
    row = lookup_peak_flops(nvml_name)
    assert (row.model if row is not None else None) == model
