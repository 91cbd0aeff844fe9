"""The run ledger: per training run energy, tokens, J/token, power, VRAM and CO2 from the sampler's
snapshots and the points the training helper pushes, without Prometheus.

Modules, top to bottom:

- ``ledger``: ``RunLedger``, the driver (threads, the lock, the snapshot history, recounts);
- ``served_views``: what /metrics and the JSON API read (``RunLedger`` inherits it);
- ``clients``: who may finish, join or continue a run, and the per-client bounds on runs; ``process_claims``:
  which processes a run has (pushed under its id, listed by NVML) and whether a new one may join;
- ``summary``: a run's figures (the summary document) from its state;
- ``runs``: a run's state, its accumulator moved over the snapshot history; ``points``: what one accepted
  point does to its run;
- ``accounting``: pure energy accounting of one snapshot interval; ``split``: pure sharing of a GPU;
- ``billing``: the billing rules (energy, window, idle, dynamic, carbon, progress), one small pure function
  each, that ``accounting`` and ``summary`` compose;
- ``snapshot_frames``: what a snapshot says about the GPUs, as plain values;
- ``store``: the SQLite database of open runs' state and finished runs' rows, and its thread; ``codec``: the
  runs' state as JSON (never pickle); ``trust``: whose directory and files may be read; ``recovery``: opening
  the store, what was lost; ``restore``: the saved records decoded one by one; ``migrate``: the previous
  releases' journal, moved into the database once;
- ``files``: the runs CSV (rows appended) and JSON summaries (written atomically), exports of the database's
  rows; ``filewriter``: the thread that writes them; ``journal``: the steady clock and the old journal's
  layout; ``restart``: checkpoints, restore after a restart, and every time placed on the steady clock;
  ``specs``: the ledger's series.

The names of the figures (CSV columns, the JSON summary's schema, the per-run series) are
``core.runs_schema``, shared with the workstation commands that read them.

How the figures are made (docs/ledger.md has the full list of columns):

- Energy is the sum over the run's GPUs (the union of the ``gpu_uuid`` labels the run pushed, MIG
  instances mapped to their parent GPU) of the deltas of ``GPUState.energy_j`` between consecutive
  snapshots, times the run's share of the GPU (``split``: exclusive, even between runs naming the
  same GPU, MIG instances in use sharing their parent); what no run gets is the GPU's unattributed energy.
  The first and last segment are cut at the run's start and end by linear interpolation of the counter.
  Power is never integrated here.
- Only ranks whose GPUs are in the snapshots (local ranks) count in the efficiency figures; tokens of
  remote ranks are counted apart (``tokens_remote``).
- A run id that has pushed no training progress (no counter point) is tentative: hidden, never charged or
  written, evicted first when the ledger is full.
- The run's end may be known only after later snapshots were taken (a late finish point, a stale run that
  ends at its last point), so the ledger keeps a short history of snapshots and per-run checkpoints of its
  accumulators and replays the history from the last checkpoint before the end.
- Tokens, samples and FLOPs are summed over the run's series (each rank counts its own); steps are the
  maximum over ranks (every data-parallel rank takes the same optimizer steps).
- Efficiency figures (tokens/s, J/token, energy per 10k tokens) cover the window after the warm-up:
  energy and tokens at the warm-up boundary are interpolated (the counter between snapshots, each token
  series between its points). A run shorter than the warm-up uses the whole run and says so.
"""

from __future__ import annotations

from gpu_energy_exporter.ledger.ledger import RunLedger

__all__ = ["RunLedger"]
