# Two commands for a fresh machine: `make run` (the main job) and `make test` (every test).
# The test environment pins torch 2.13.0, the CPU build: a bare `torch` would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
LANES  := 2.3.1 2.4.1 2.6.0 2.8.0 2.14.1
VENV_CACHE ?= $(HOME)/.cache/hybrid-kit/venvs
COMPAT := report/compat
lane_dir = $(VENV_CACHE)/torch-$(1)-$(shell sha256sum requirements-torch-$(1).txt | cut -c1-10)
PY     := $(VENV)/bin/python

.PHONY: run test test-modern test-local test-slurm test-lanes lane-files compat-check compat-table venv lanes slurm-deps sweep speed budget gpu-check \
        clean

run: venv
	$(PY) bench_ddp_transformer.py

# Everything on the pinned torch, then the matrix's core on every other release, then the compatibility table
# (docs/releases.md) against what those runs showed (each run writes $(COMPAT)/torch-<version>.json).
# The Slurm tests mostly wait (on slurmctld, on a credential to expire, on a requeued job), so they run beside the
# lanes (-j2: the Slurm tests, and one lane at a time); the other tests run alone first, as some of them time things.
# Each part runs whatever another failed (-k, status kept): one `make test` shows every failure.
test: venv lanes slurm-deps
	rm -rf $(COMPAT)
	@s=0; $(MAKE) --no-print-directory test-local || s=1; \
	 $(MAKE) --no-print-directory -k -j2 --output-sync=target test-slurm test-lanes || s=1; \
	 $(MAKE) --no-print-directory compat-check || s=1; exit $$s

# Current torch: everything but the torch 2.3 tests (test-local, then test-slurm, in one run); the Slurm tests start
# (and stop) their own cluster.
test-modern: venv
	KIT_COMPAT_DIR=$(COMPAT) $(PY) -m pytest -m "not legacy" tests
test-local: venv
	KIT_COMPAT_DIR=$(COMPAT) $(PY) -m pytest -m "not legacy and not slurm" tests
test-slurm: venv
	KIT_COMPAT_DIR=$(COMPAT) $(PY) -m pytest -m "slurm and not legacy" tests

# The matrix: the `core` tests in each lane's venv (and on 2.3.1 the torch 2.3 tests: Pipe, torchtext). Only the files
# that hold them are collected (collecting all of tests/ took 8 of each lane's seconds); tests/test_house.py checks
# this list against what pytest collects.
LANE_FILES := $(shell grep -l "mark\.core\|mark\.legacy" tests/test_*.py)
test-lanes: $(addprefix test-lane-,$(LANES))
lane-files:
	@echo $(LANE_FILES)
test-lane-%:
	@d=$(call lane_dir,$*); if [ -f $$d/.installed ]; then \
	   echo "== lane torch $* ($$d)"; \
	   KIT_COMPAT_DIR=$(COMPAT) $$d/bin/python -m pytest -q -m "core$(if $(filter 2.3.%,$*), or legacy)" $(LANE_FILES); \
	 else echo "make: lane torch $* was not built ($$d): not tested"; [ "$$KIT_REQUIRE_LANES" != 1 ] || exit 1; fi

compat-check: venv
	$(PY) tests/compat_table.py $(COMPAT) --check docs/releases.md

# After a `make test` that changed what a release can do: write the table into docs/releases.md (then commit it).
compat-table: venv
	$(PY) tests/compat_table.py $(COMPAT) --write docs/releases.md

# The page's sweep at small scale on this CPU, then its table and plot in report/ (about 10 minutes on 2 cores).
sweep: venv
	rm -f report/cpu_sweep.jsonl
	PYTHON=$(PY) slurm/sweep_local.sh report/cpu_sweep.jsonl
	$(PY) slurm/report.py report/cpu_sweep.jsonl --out report --title "CPU sweep (gloo, 2 cores): not a GPU result"

# The speed model against the trainers' own runs on this CPU (benchmarks/speed_grid.py: 32 splits x 5 repeats,
# about 35 minutes on 2 cores); docs/speed.md quotes it.
speed: venv
	$(PY) benchmarks/speed_grid.py

# The performance budget (benchmarks/budget.py): ratios measured in one run; docs/speed.md quotes them.
budget: venv lane-2.3.1
	$(PY) benchmarks/budget.py $$( d=$(call lane_dir,2.3.1); [ -f $$d/.installed ] && echo --legacy $$d/bin/python )

# Everything a GPU machine should run, in at most 8 minutes on one GPU, with that machine's python: the default model
# learning, the script against a bare loop (benchmarks/gpu_check.py), the memory estimate against the allocator
# (benchmarks/memory_gpu.py), the speed profile and --advise on it (benchmarks/gpu_all.py). One report:
# report/gpu/REPORT.md, the logs beside it. make gpu-check GPU_PYTHON=python3
# Where that python lacks fairscale or python-hostlist: `make gpu-wheels` on a machine with the internet first, and
# bring $(GPU_WHEELS)/ along (git ignores it); gpu-check installs them from there.
GPU_PYTHON ?= $(PY)
GPU_WHEELS ?= .whl
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_all.py --out report/gpu --wheels $(GPU_WHEELS)

# Both are sources only on PyPI (pure Python): downloaded, then built into wheels, with any python that has pip.
.PHONY: gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS) && d=$$(mktemp -d) && \
	 $(PYTHON) -m pip download -q --no-deps --no-binary :all: -d $$d fairscale==0.4.13 python-hostlist==2.3.0 && \
	 $(PYTHON) -m pip wheel -q --no-deps -w $(GPU_WHEELS) $$d/*; s=$$?; rm -rf $$d; exit $$s

venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

# One venv per tested torch release (the matrix), in one cache folder outside the work tree, keyed by the release
# and a hash of its requirements file: CI's fresh clone reuses them, a fresh machine builds each once (about 5 GB
# and a few minutes each: PyPI's builds are the CUDA ones; they run on the CPU). A half-built venv has no .installed
# and is rebuilt. Where one cannot be built its lane says so and is left out, except in CI where
# KIT_REQUIRE_LANES=1 makes that a failure.
lanes: $(addprefix lane-,$(LANES))
lane-%:
	@req=requirements-torch-$*.txt; [ -f $$req ] || { echo "make: no $$req (lanes: $(LANES))"; exit 2; }; \
	 d=$(call lane_dir,$*); mkdir -p $(VENV_CACHE); \
	 flock $$d.lock sh -c '[ -f '$$d'/.installed ] || { echo "make: building lane torch $* in '$$d'"; \
	   rm -rf '$$d' && $(PYTHON) -m venv '$$d' && \
	   '$$d'/bin/python -m pip install -q --disable-pip-version-check -r '$$req' && touch '$$d'/.installed; }' || \
	 { echo "make: could not build lane torch $* in $$d; its row is left out of the matrix"; \
	   [ "$$KIT_REQUIRE_LANES" != 1 ] || exit 1; }

# Debian's slurm-wlm + munge for the real-Slurm tests, and slurmdbd + mariadb-server for the accounting ones
# (tests/test_site_slurmdbd.py: QoS and associations enforced by a real slurmdbd). Root only; each group is installed
# only if missing, and the tests that need a missing one skip and say why.
slurm-deps:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) || \
		echo "make: could not install slurm-wlm munge; the Slurm tests will skip and say why"; \
	else echo "make: slurm-wlm not installed and not root; the Slurm tests will skip and say why"; fi
	@if command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmdbd mariadb-server >/dev/null) || \
		echo "make: could not install slurmdbd mariadb-server; the Slurm accounting tests will skip and say why"; \
	else echo "make: slurmdbd or mariadb-server not installed and not root; the Slurm accounting tests will skip" \
		"and say why (they need a real accounting database)"; fi

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs report  # the lanes' venvs stay in $(VENV_CACHE)
