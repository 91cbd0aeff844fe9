"""The health collector: Xid and ECC events, ECC counts, row remapping, retired pages, PCIe and NVLink (the
readings are devices.nvml_health's, the shared values core.health's)."""
