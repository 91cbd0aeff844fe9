#!/bin/sh
# gpu-energy-exporter: Slurm prolog. Records which GPUs this job holds in the job-mapping directory that
# `gpu-energy-exporter --collector.slurm` reads (dcgm-exporter's DCGM_HPC_JOB_MAPPING_DIR format: one file
# per GPU index, or "<index>.<gpu instance>" for a MIG instance, one job id per line), plus
# .info/<job id> (user, account, partition, SLUID) for the job's info series.
#
# Install (slurm.conf):  Prolog=/etc/slurm/prolog.d/gpu-energy-prolog.sh  and  PrologFlags=Alloc
# (or call it from your existing prolog). Runs as root on the compute node.
#
# Safe by design: it never talks to the exporter (works while the exporter is down or restarting), is
# idempotent (running it twice lists the job once), takes a lock so concurrent jobs on a shared GPU never
# lose each other's lines, writes each file atomically (temp file + rename), and always exits 0, since a
# failing prolog drains the node. Problems go to syslog (logger) and stderr.
#
# Settings (environment, or /etc/default/gpu-energy-exporter-slurm):
#   GPU_ENERGY_JOB_MAPPING_DIR   default /run/gpu-energy-exporter/slurm-jobs
#   GPU_ENERGY_JOB_GPUS          override the GPU list (default: SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES,
#                                else GPU_DEVICE_ORDINAL): indices "0,1", ranges "0-3", MIG "0.1"
[ -r /etc/default/gpu-energy-exporter-slurm ] && . /etc/default/gpu-energy-exporter-slurm
dir="${GPU_ENERGY_JOB_MAPPING_DIR:-/run/gpu-energy-exporter/slurm-jobs}"
job="${SLURM_JOB_ID:-}"

say() { logger -t gpu-energy-prolog "$*" 2>/dev/null; echo "gpu-energy-prolog: $*" >&2; }

case "$job" in
  ''|*[!0-9_+]*) say "SLURM_JOB_ID '$job' is not a job id: nothing recorded"; exit 0 ;;
esac

gpus="${GPU_ENERGY_JOB_GPUS:-${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-${GPU_DEVICE_ORDINAL:-}}}}"
[ -n "$gpus" ] || exit 0   # a job without GPUs

# "0,2-3,1.4" -> "0 2 3 1.4"; anything else (a GPU UUID, NoDevFiles) is named and skipped
expand() {
  for tok in $(echo "$1" | tr ',' ' '); do
    case "$tok" in
      *[!0-9.-]*|'') say "job $job: GPU '$tok' is not an index (N, N-M or N.GI): skipped" ;;
      *-*) lo=${tok%-*}; hi=${tok#*-}
           case "$lo$hi" in *[!0-9]*|'') say "job $job: bad GPU range '$tok': skipped"; continue ;; esac
           i=$lo; while [ "$i" -le "$hi" ]; do echo "$i"; i=$((i + 1)); done ;;
      *) echo "$tok" ;;
    esac
  done
}

umask 022
mkdir -p "$dir/.info" 2>/dev/null || { say "cannot create $dir: job $job not recorded"; exit 0; }

# One lock for the directory: flock where util-linux has it, else a mkdir lock with a bounded wait.
lock() {
  if command -v flock >/dev/null 2>&1; then exec 9>"$dir/.lock" && flock -w 10 9 && return 0; return 1; fi
  n=0; while ! mkdir "$dir/.lockdir" 2>/dev/null; do
    n=$((n + 1)); [ "$n" -gt 100 ] && { rmdir "$dir/.lockdir" 2>/dev/null; n=0; }; sleep 0.1
  done
  trap 'rmdir "$dir/.lockdir" 2>/dev/null' EXIT
}
lock || say "job $job: could not lock $dir, writing anyway"

# The job's info first, then its GPU files: a reader that sees the job on a GPU finds who ran it.
clean() { printf '%s' "$1" | tr -cd 'A-Za-z0-9._@+-' | cut -c1-128; }
tmp="$dir/.info/.tmp.$job.$$"
{
  echo "user=$(clean "${SLURM_JOB_USER:-}")"
  echo "account=$(clean "${SLURM_JOB_ACCOUNT:-}")"
  echo "partition=$(clean "${SLURM_JOB_PARTITION:-}")"
  echo "sluid=$(clean "${SLURM_JOB_SLUID:-}")"
} > "$tmp" 2>/dev/null && mv -f "$tmp" "$dir/.info/$job" || rm -f "$tmp"

for gpu in $(expand "$gpus"); do
  f="$dir/$gpu"
  if [ -f "$f" ] && grep -qx "$job" "$f"; then continue; fi
  tmp="$dir/.tmp.$gpu.$$"
  { [ -f "$f" ] && cat "$f"; echo "$job"; } > "$tmp" 2>/dev/null && mv -f "$tmp" "$f" \
    || { rm -f "$tmp"; say "job $job: cannot write $f"; }
done

exit 0
