#!/usr/bin/env bash
# Everything that needs a real NVIDIA GPU, in one go (docs/gpu-validation.md): the GPU tests (`make test-gpu`),
# the real-driver benchmarks (exporter cost, CPU per NVML call and the power-sample buffer, nvitop-exporter
# side by side). Figures and logs go to $OUT (default ./gpu-report).
#
# A GPU machine without a package registry: put the wheels of the packages it lacks in .whl/ beforehand
# (docs/gpu-validation.md lists them); they are installed into /tmp/site, never into the system Python.
# With the project's venv instead: PY=.venv/bin/python bash bench/real_gpu.sh
set -u
PY=${PY:-python3}
OUT=${OUT:-$PWD/gpu-report}
mkdir -p "$OUT/r"
export GPU_REPORT_DIR=$OUT/r PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,pci.bus_id,power.limit,power.draw,mig.mode.current,persistence_mode \
        --format=csv
    "$PY" --version; nproc; uname -r
    "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|nvidia-ml-py|grpcio|protobuf|opentelemetry-sdk|nvitop) "
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step() {  # step SECONDS LOG COMMAND...: one step, bounded, its output kept; a failed step does not stop the others
    local limit=$1 log=$2
    shift 2
    echo "== $* (at most ${limit}s)" | tee -a "$OUT/$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    echo "== rc ${PIPESTATUS[0]}" | tee -a "$OUT/$log"
}
STEPS=" ${STEPS:-tests probe cost peers} "  # any of them, e.g. STEPS="tests cost" for a shorter lease
case $STEPS in *" tests "*)
    step 200 pytest.log "$PY" -m pytest -m gpu -p no:cacheprovider -ra tests/test_gpu_real.py \
        tests/test_training_helper.py tests/test_training_torch.py ;; esac
case $STEPS in *" probe "*) step 80 bench.md "$PY" -m bench.real_probe --real-driver ;; esac
case $STEPS in *" cost "*) step 150 bench.md "$PY" -m bench.exporter_cost --real-driver ;; esac
case $STEPS in *" peers "*) step 120 bench.md "$PY" -m bench.peers --real-driver ;; esac
tar czf "$OUT/report.tgz" -C "$OUT" r
