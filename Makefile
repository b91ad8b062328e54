# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo test test-chaos lint docs constraints bench bench-peers clean bwrap test-tools

# Debian packages the tests drive, as command=package: bubblewrap (agents run in it,
# docs/sandbox.md), chromium (the dashboard's browser tests; Playwright's own browser
# cannot be downloaded here), promtool from prometheus (the alert rules in
# deploy/prometheus; its server is not started), tmux (`runlane top` in a real
# terminal) and pgbouncer (the suites run through it in transaction pooling mode; each
# test process starts its own, tests/pgbouncer.py). What is missing is installed after one apt-get update when root (the
# prometheus package without its recommends: only promtool is used), else the command
# to run is printed.
TEST_TOOLS := bwrap=bubblewrap chromium=chromium promtool=prometheus tmux=tmux pgbouncer=pgbouncer

define install_missing
	@missing=""; for pair in $(1); do \
	  command -v "$${pair%%=*}" >/dev/null 2>&1 || missing="$$missing $${pair#*=}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update || exit 1; \
	    for pkg in $$missing; do case "$$pkg" in \
	      prometheus) lean="$$lean $$pkg";; *) full="$$full $$pkg";; esac; done; \
	    if [ -n "$$full" ]; then apt-get install -y $$full || exit 1; fi; \
	    if [ -n "$$lean" ]; then apt-get install -y --no-install-recommends $$lean || exit 1; fi; \
	  else \
	    echo "error: missing Debian packages:$$missing: sudo apt-get install -y$$missing" \
	      "$(2)" >&2; \
	    exit 1; \
	  fi; \
	fi
endef

# `make demo` needs only bubblewrap, and not even that with RUNLANE_SANDBOX=off.
bwrap:
	@[ "$$RUNLANE_SANDBOX" = off ] || $(MAKE) --no-print-directory _bwrap
_bwrap:
	$(call install_missing,bwrap=bubblewrap,(or dnf install bubblewrap); or run agents without a sandbox: RUNLANE_SANDBOX=off make demo)

test-tools:
	$(call install_missing,$(TEST_TOOLS),)

# The development install takes every package at the version constraints.txt pins, so
# `make test` installs the same versions on every machine. `make constraints` pins them
# again (the newest versions pyproject.toml allows, resolved in a fresh venv).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

CONSTRAINTS_VENV := .venv-constraints

constraints:
	rm -rf $(CONSTRAINTS_VENV)
	$(PYTHON) -m venv $(CONSTRAINTS_VENV)
	$(CONSTRAINTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CONSTRAINTS_VENV)/bin/python -m pip install --quiet -e '.[dev]'
	{ echo "# Exact versions of everything \`make test\` installs (pip install -c constraints.txt)."; \
	  echo "# Regenerate with: make constraints"; \
	  $(CONSTRAINTS_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^runlane[= ]'; \
	} > constraints.txt
	rm -rf $(CONSTRAINTS_VENV)

# The tests' scratch files (clones and workspaces by the thousand, SQLite files, the
# fault harness's private PostgreSQL) go to tmpfs where there is one: on an ext4 without
# a journal each new file scans the inodes deleted in the last minute, and a suite that
# creates and removes workspaces all along spends most of its time there (the fault
# harness's short profile: 159 s on such a /tmp, 109 s on /dev/shm).
TEST_TMP := $(shell [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm/runlane-test-$$(id -u))
# The suite starts runlane processes by the thousand (CLI calls, workers, the fault
# harness's): from bytecode, each starts in 0.66 s instead of 1.0 s where
# PYTHONDONTWRITEBYTECODE is set (every process would compile every module again).
COMPILE := $(BIN)/python -m compileall -q -j 0 src >/dev/null
TEST_ENV := $(if $(TEST_TMP),mkdir -p $(TEST_TMP) && TMPDIR=$(TEST_TMP),)

demo: $(STAMP) bwrap
	$(BIN)/runlane demo

# Lint, types, the main suite on two processes, then the fault harness's real runs
# (tests marked chaos: the short PostgreSQL profile, the SQLite profile, the planted
# bugs and their control), one at a time after the main suite, so that nothing else
# of the suite competes with their recovery-time figures (about 5 minutes).
test: $(STAMP) test-tools
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(COMPILE)
	$(TEST_ENV) $(BIN)/pytest -n 2 --dist loadgroup -m "not chaos" --durations=25
	$(TEST_ENV) $(BIN)/pytest -m chaos

# The fault harness's real runs alone (the second half of `make test`).
test-chaos: $(STAMP) test-tools
	$(COMPILE)
	$(TEST_ENV) $(BIN)/pytest -m chaos

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The documentation site (MkDocs, Material theme) into site/; strict: a broken link or
# a page missing from the nav fails the build (tests/test_docs.py builds it too).
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

PEERS_VENV := bench/.venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed-$(shell cksum < bench/requirements-peers.txt | cut -d' ' -f1)

$(PEERS_STAMP): bench/requirements-peers.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet -r bench/requirements-peers.txt
	rm -f $(PEERS_VENV)/.installed-* && touch $(PEERS_STAMP)

bench: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python bench/lifecycle.py --write docs/benchmarks.md
	$(BIN)/python bench/peers.py --write docs/benchmarks.md
	$(BIN)/python bench/sizes.py --write docs/benchmarks.md

bench-peers: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python bench/peers.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) runlane-demo site .pytest_cache .mypy_cache .ruff_cache .hypothesis
