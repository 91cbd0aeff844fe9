"""Slurm: which GPUs each job holds (the job-mapping directory, the job cgroups) and per-job energy.

Pure code: parsing and accounting. The collector that drives it (reads the directory on the sampler
thread) is ``collectors.slurm``.
"""
