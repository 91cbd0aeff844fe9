#!/bin/sh
# gpu-energy-exporter: Slurm epilog. Removes this job from every GPU file of the job-mapping directory
# (see gpu-energy-prolog.sh) and deletes its .info file. It looks in every GPU file, not only the GPUs in
# the environment, so a job is never left behind when the epilog sees other variables than the prolog did.
# Idempotent, never talks to the exporter, always exits 0.
#
# Install (slurm.conf):  Epilog=/etc/slurm/epilog.d/gpu-energy-epilog.sh
[ -r /etc/default/gpu-energy-exporter-slurm ] && . /etc/default/gpu-energy-exporter-slurm
dir="${GPU_ENERGY_JOB_MAPPING_DIR:-/run/gpu-energy-exporter/slurm-jobs}"
job="${SLURM_JOB_ID:-}"

say() { logger -t gpu-energy-epilog "$*" 2>/dev/null; echo "gpu-energy-epilog: $*" >&2; }

case "$job" in
  ''|*[!0-9_+]*) say "SLURM_JOB_ID '$job' is not a job id: nothing removed"; exit 0 ;;
esac
[ -d "$dir" ] || exit 0

lock() {
  if command -v flock >/dev/null 2>&1; then exec 9>"$dir/.lock" && flock -w 10 9 && return 0; return 1; fi
  n=0; while ! mkdir "$dir/.lockdir" 2>/dev/null; do
    n=$((n + 1)); [ "$n" -gt 100 ] && { rmdir "$dir/.lockdir" 2>/dev/null; n=0; }; sleep 0.1
  done
  trap 'rmdir "$dir/.lockdir" 2>/dev/null' EXIT
}
lock || say "job $job: could not lock $dir, writing anyway"

for f in "$dir"/*; do
  name=${f##*/}
  case "$name" in *[!0-9.]*|'') continue ;; esac
  [ -f "$f" ] || continue
  grep -qx "$job" "$f" || continue
  tmp="$dir/.tmp.$name.$$"
  grep -vx "$job" "$f" > "$tmp"
  if [ -s "$tmp" ]; then mv -f "$tmp" "$f" || say "job $job: cannot rewrite $f"
  else rm -f "$tmp" "$f"; fi
done
rm -f "$dir/.info/$job"
exit 0
