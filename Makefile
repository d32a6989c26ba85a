# Two commands for a fresh machine: `make run` (the main job) and `make test` (every test).
# The test environment pins torch 2.13.0, the CPU build: a bare `torch` would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
LEGACY := .venv-legacy
PY     := $(VENV)/bin/python

.PHONY: run test test-modern test-legacy venv legacy slurm-deps sweep budget clean

run: venv
	$(PY) bench_ddp_transformer.py

test: venv legacy slurm-deps
	$(MAKE) --no-print-directory test-modern test-legacy

# Current torch: everything but the legacy lane; the Slurm tests start (and stop) their own cluster.
test-modern: venv
	$(PY) -m pytest -m "not legacy" tests

# torch 2.3 lane (the documented Pipe, torchtext); where its venv could not be made the tests skip and say why.
test-legacy: venv
	if [ -x $(LEGACY)/bin/python ] && [ -f $(LEGACY)/.installed ]; then \
		$(LEGACY)/bin/python -m pytest -m "legacy or multiproc" tests; \
	else \
		$(PY) -m pytest -m legacy tests; \
	fi

# The page's sweep at small scale on this CPU, then its table and plot in report/ (about 10 minutes on 2 cores).
sweep: venv
	rm -f report/cpu_sweep.jsonl
	PYTHON=$(PY) slurm/sweep_local.sh report/cpu_sweep.jsonl
	$(PY) slurm/report.py report/cpu_sweep.jsonl --out report --title "CPU sweep (gloo, 2 cores): not a GPU result"

# The performance budget (benchmarks/budget.py): ratios measured in one run; README quotes them.
budget: venv legacy
	$(PY) benchmarks/budget.py $$( [ -f $(LEGACY)/.installed ] && echo --legacy $(LEGACY)/bin/python )

venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

# About a minute and 5 GB (PyPI's torch 2.3.1 is the CUDA build; it runs on the CPU). Failure is not fatal here:
# the legacy tests then skip with the reason, except in CI where KIT_REQUIRE_LEGACY=1 turns that into a failure.
legacy: $(LEGACY)/.installed
$(LEGACY)/.installed: requirements-legacy.txt
	@$(PYTHON) -m venv $(LEGACY) && \
	 $(LEGACY)/bin/pip install -q --disable-pip-version-check -r requirements-legacy.txt && touch $@ || \
	 echo "make: could not build the torch 2.3 lane in $(LEGACY); its tests will skip and say why"

# Debian's slurm-wlm + munge for the real-Slurm tests (root only; the tests skip and say why otherwise).
slurm-deps:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) || \
		echo "make: could not install slurm-wlm munge; the Slurm tests will skip and say why"; \
	else echo "make: slurm-wlm not installed and not root; the Slurm tests will skip and say why"; fi

clean:
	rm -rf $(VENV) $(LEGACY) .pytest_cache .hypothesis runs report
