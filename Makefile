# deploytool: a fresh machine needs `make demo`, `make check` (the inner loop) and `make test`; each does all set-up.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
# workers side by side (pytest-xdist): most of the suite waits on real servers and systemd, not on the CPU;
# tests/support/groups.py keeps what shares a box, a fleet or a module's fixtures on one worker. 0: one process
TEST_WORKERS ?= 3
# make check: what needs no sandbox, no real backend and no fleet, and is not `slow`, its property tests on a quarter
# of their examples (DEPLOYTOOL_TEST_QUICK=1: tests/support/examples.py; docs/development/tests.md);
# three workers on this 2-core machine: a third fills the time the others wait on pip, nvcc and pack's children
# (1 min 59 s against 2 min 17 s for two, side by side: bench/RESULTS.md)
CHECK_MARKERS := not sandbox and not backends and not fleet and not slow
CHECK_WORKERS ?= 3

.PHONY: setup check test test-e2e demo golden docs bench lint typecheck rebuild-check collection collection-readme sanity clean help

help:
	@echo "make demo           install, switch and rollback on a sandboxed real systemd with real CPU backends"
	@echo "make check          the fast suite (no sandbox, backends, fleet or slow tests) and the lint, in minutes"
	@echo "make test           the whole test suite (sets everything up first); PYTEST_ARGS=... passes options"
	@echo "make test-e2e       the end-to-end CLI suite alone (tests/test_e2e.py)"
	@echo "make setup          system packages, .venv, deploytool, the real CPU backends, test tools"
	@echo "make golden         re-render units/ from the two-2080ti example on purpose"
	@echo "make docs           regenerate docs/reference/ (CLI, exit codes, config keys, checks) from the code"
	@echo "make bench          run every benchmark script in bench/, print their figures, name those that missed"
	@echo "make lint           ruff + mypy exactly as CI runs them"
	@echo "make typecheck      mypy alone"
	@echo "make rebuild-check  rebuild a bundle's venv offline and compare its native libraries"
	@echo "                    (BUNDLE=path CONFIG=path KEYS=dir; default: the newest bundle beside ./deploytool.yaml)"
	@echo "make collection     build the deploytool.fleet Ansible collection into artifacts/ (ansible-galaxy)"
	@echo "make collection-readme  regenerate the module reference in ansible/README.md from the modules' docs"
	@echo "make sanity         ansible-test sanity of the collection as built (scripts/sanity.sh; ARGS=... passes options)"
	@echo "make clean          remove build leftovers and caches of the checkout"

$(STAMP): setup.cfg scripts/setup.sh tests/requirements.txt deploy_tool/examples/cpu-demo/requirements.in \
         tests/support/fleet/requirements.txt scripts/ansible-test-get-pip.py
	bash scripts/setup.sh
	@touch $(STAMP)

setup: $(STAMP)

check: setup
	DEPLOYTOOL_TEST_QUICK=1 $(VPY) -m pytest -n $(CHECK_WORKERS) --dist loadgroup -m "$(CHECK_MARKERS)" $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory lint

test: setup
	$(VPY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-e2e: setup
	$(VPY) -m pytest -m e2e tests/test_e2e.py

demo: setup
	bash scripts/demo.sh

golden: setup
	$(VPY) -m deploy_tool.builder.golden

docs: setup
	$(VPY) scripts/docs_reference.py
	$(VPY) scripts/man_page.py

bench: setup
	@missed=""; for b in bench/bench_*.py; do echo "== $$b"; $(VPY) $$b || missed="$$missed $$b"; done; \
	if [ -n "$$missed" ]; then echo "missed a goal or failed:$$missed"; exit 1; fi

lint: setup
	$(VENV)/bin/ruff check deploy_tool tests bench scripts/docs_reference.py scripts/man_page.py
	$(VENV)/bin/mypy deploy_tool

typecheck: setup
	$(VENV)/bin/mypy deploy_tool

rebuild-check: setup
	bash scripts/rebuild-check.sh

collection: setup
	.cache/fleet-ansible/bin/ansible-galaxy collection build ansible --output-path artifacts --force

collection-readme: setup
	$(VPY) scripts/collection_readme.py

sanity: setup
	bash scripts/sanity.sh $(ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache demo-run
