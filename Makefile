# The two commands (see README.md):
#   make run    install the exporter (with what the README's workstation path uses: the demo's trainer,
#               top, runs, report with its plots) into .venv and start it (extra flags: make run ARGS="--help")
#   make test   install everything the tests need (Python packages, Debian's prometheus) and run the suite
# Both set themselves up from nothing on a fresh machine; .ci/run calls `make test`.

VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
PYTEST_ARGS ?=
# `make test` runs test files on this many pytest-xdist workers (one file's tests stay on one worker, so a
# module's exporter or Prometheus is started once). Most of the suite waits on exporters, servers and clocks,
# so two workers on two cores take about 11 minutes where one took 16. TEST_WORKERS=0 runs it in-process.
TEST_WORKERS ?= 2

.PHONY: run test test-fast test-gpu test-container test-arm64 screenshots bench docs lint dashboards dist clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The [report] extra: matplotlib for `report`'s plots (README: "Try it without a GPU").
$(VENV)/.run-installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[report]'
	touch $@

$(VENV)/.test-installed: pyproject.toml .ci/setup-test-env | $(VENV)/bin/python
	bash .ci/setup-test-env $(VENV)
	touch $@

run: $(VENV)/.run-installed
	$(VENV)/bin/gpu-energy-exporter $(ARGS)

test: $(VENV)/.test-installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The fast tier, for every change: pure and in-process tests (no other process, no Prometheus, no torch;
# tests/conftest.py marks the rest `full`), about 40 s on two cores. `make test` stays the whole suite.
test-fast: $(VENV)/.test-installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not full and not arm64" --durations=10 $(PYTEST_ARGS)

# On a machine with an NVIDIA GPU and driver (skipped, saying why, elsewhere): identity and a full reading of
# every GPU; the energy counter against 50 ms instant power and 1 s average x time under a bursty bf16 matmul
# load; utilisation and GPM SM/tensor activity under load; the whole exporter with a CUDA training loop
# (ledger tokens, J/token, /metrics latency); token counting that never synchronises. GPU_REPORT_DIR=dir
# writes the figures as JSON (docs/gpu-validation.md). What the exporter costs on that driver:
# `$(PY) -m bench.exporter_cost --real-driver`; all of it at once, with CPU per NVML call and nvitop-exporter
# side by side: `PY=$(PY) bash bench/real_gpu.sh` (figures under ./gpu-report).
test-gpu: $(VENV)/.test-installed
	$(PY) -m pytest -m gpu -p no:cacheprovider $(PYTEST_ARGS)

# Build the Dockerfile with buildah on a Debian stand-in base image and run it: amd64 (also part of
# `make test`) and arm64 under qemu emulation (not part of `make test`: about 3 min, 5.5 on a first run).
test-container: $(VENV)/.test-installed
	$(PY) -m pytest -m container $(PYTEST_ARGS)

# Only the arm64 image (tests/test_container_arm64.py); needs qemu-user-static and binfmt_misc.
test-arm64: $(VENV)/.test-installed
	$(PY) -m pytest -m arm64 $(PYTEST_ARGS)

bench: $(VENV)/.test-installed
	$(PY) -m bench $(ARGS)

docs: $(VENV)/.test-installed
	$(PY) -m gpu_energy_exporter.tools.docgen
	$(PY) -m dashboards.build
	$(PY) deploy/generate.py

# The README's screenshot of `top` (docs/img/top.txt, top.png): runs the demo for about two minutes and
# renders top from what it served (tests/screenshots.py; tests/test_screenshots.py checks top.txt).
screenshots: $(VENV)/.test-installed
	$(PY) tests/screenshots.py capture

# Rebuild the Grafana dashboards JSON, their docs section and the Kubernetes objects made from them.
dashboards: $(VENV)/.test-installed
	$(PY) -m dashboards.build
	$(PY) deploy/generate.py

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check gpu_energy_exporter tests bench dashboards deploy
	$(VENV)/bin/mypy gpu_energy_exporter
	$(VENV)/bin/lint-imports

# The sdist and wheel in dist/ (pip install dist/gpu_energy_exporter-*.whl), metadata checked by twine.
dist: | $(VENV)/bin/python
	$(PY) -m pip install -q build twine
	rm -rf dist
	$(PY) -m build --outdir dist .
	rm -rf build *.egg-info
	$(PY) -m twine check --strict dist/*

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .build
