"""The run ledger: per-run energy, tokens and efficiency from the sampler's snapshots."""
