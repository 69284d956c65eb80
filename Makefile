# Two commands set everything up on a fresh Debian 12 + Python 3.11 machine:
#   make demo   creates .venv, installs the main job's needs, runs the demo
#   make test   creates .venv, installs everything (test, export and docs extras too), builds the docs
#               site (mkdocs --strict) and runs pytest
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
OUT ?= runs/demo-fleet

.PHONY: demo test typecheck test-slow test-attacks test-all test-loaded docs bench apt-data apt-broker apt-browser apt-service apt-http apt-cluster clean-venv

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned and installed first, alone, so no other package can pull a different build.
$(VENV)/.stamp-main: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[server]'
	$(BIN)/python -m pip install -q --no-deps dp-accounting==0.6.0  # see the privacy extra in pyproject.toml
	@$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

$(VENV)/.stamp-all: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[all,test,dev,docs]'
	$(BIN)/python -m pip install -q --no-deps dp-accounting==0.6.0  # see the privacy extra in pyproject.toml
	@$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@ $(VENV)/.stamp-main

# Debian packages: installed only when missing (root, or sudo when available).
apt-data:
	@[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist)

apt-broker:
	@command -v mosquitto >/dev/null 2>&1 && command -v mosquitto_passwd >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq mosquitto mosquitto-clients)

# the dashboard tests drive a real headless browser (Debian's chromium)
apt-browser:
	@command -v chromium >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium)

# the service tests: systemd-analyze verify (units), promtool and a real Prometheus (metrics, alert rules);
# installed without starting the package's own Prometheus service (deploy/apt-no-start.sh)
apt-service:
	@command -v systemd-analyze >/dev/null 2>&1 || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq systemd)
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) sh deploy/apt-no-start.sh prometheus)

# models over HTTP: Debian's nginx serves the model files in the tests and the emulator (flayer models serve);
# installed without starting the package's own nginx on :80 (deploy/apt-no-start.sh)
apt-http:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || \
	  ($(SUDO) apt-get update -qq && $(SUDO) sh deploy/apt-no-start.sh nginx)

# the clustered broker (flayer broker start --cluster N; docs/howto/clustered-broker.md): Redis, installed without
# starting Debian's own Redis service (deploy/apt-no-start.sh), Node.js 20+ and the Aedes packages pinned in
# mqtt_broker/aedes/package-lock.json, installed into mqtt_broker/aedes/node_modules (npm ci, again only when the
# lock file is newer). With an older Node.js the cluster tests skip, saying why.
AEDES := mqtt_broker/aedes
apt-cluster:
	@command -v redis-server >/dev/null 2>&1 || ($(SUDO) apt-get update -qq && $(SUDO) sh deploy/apt-no-start.sh redis-server)
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm)
	@if ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)'; then \
	  echo "apt-cluster: Aedes needs Node.js 20 or newer, found $$(node --version): the cluster tests will skip" >&2; \
	elif [ ! $(AEDES)/node_modules/.package-lock.json -nt $(AEDES)/package-lock.json ]; then \
	  npm ci --prefix $(AEDES) --no-audit --no-fund --loglevel=error; fi

# 20 emulated devices with mixed profiles over a real broker (mosquitto when installed, else the embedded one);
# it prints the live dashboard's address (http://127.0.0.1:8765/ unless that port is taken): open it to watch
demo: apt-data $(VENV)/.stamp-main
	$(BIN)/flayer emulate --config configs/emulate-demo.toml --out $(OUT) --dashboard

# -n $(WORKERS): pytest-xdist, one worker per core (every test takes its own ports, folders and brokers);
# --durations=10: the ten slowest tests show in every run (and so in every CI log)
WORKERS ?= auto
TEST_DEPS := apt-data apt-broker apt-http apt-browser apt-service apt-cluster $(VENV)/.stamp-all
test: $(TEST_DEPS) docs typecheck
	@$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --no-loadscope-reorder --durations=10; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; exit 1; fi; exit $$rc

# the type checker over the coordinator and the engine (the settings: [tool.mypy] in pyproject.toml)
typecheck: $(VENV)/.stamp-all
	$(BIN)/python -m mypy coordinator flayer/engine

# the tests kept out of the default run (-m slow: crash, failover, cluster, gateway and SIGTERM faults), in
# parallel too; none collected (exit 5) is no failure here. A failed one runs once more: process kills on a
# shared two-core machine are timing-sensitive; a rerun shows as R in the output and in the summary
test-slow: $(TEST_DEPS)
	@$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --no-loadscope-reorder -m slow --reruns 1 --reruns-delay 2 -raR --durations=10; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test-slow: no slow tests collected"; exit 0; fi; exit $$rc

# the attack tests (tests/attacks/: each guarantee the docs state, tried as its adversary would), slow ones too;
# a tree with none yet (exit 5) is no failure
test-attacks: $(TEST_DEPS)
	@if [ ! -d tests/attacks ]; then echo "make test-attacks: no tests/attacks folder"; exit 0; fi; \
	  $(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --no-loadscope-reorder -m '' tests/attacks --durations=10; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test-attacks: no attack tests collected"; exit 0; fi; exit $$rc

# the documentation site: a broken link or anchor, a page missing from the nav or a failing generated
# reference fails the build (not --quiet: with it, mkdocs 1.6 does not count the warnings --strict fails on)
docs: $(VENV)/.stamp-all
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# slow and benchmark-like tests too
test-all: $(TEST_DEPS)
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --no-loadscope-reorder -m ''

# the default suite with one core kept busy by a bounded process of its own, beside an idle run
test-loaded: apt-data apt-broker apt-http apt-browser apt-service apt-cluster $(VENV)/.stamp-all docs
	$(BIN)/python benchmarks/suite_under_load.py --log-dir runs/suite-under-load

bench: apt-data apt-broker apt-http $(VENV)/.stamp-all
	$(BIN)/python benchmarks/local_round.py --repeats 21
	$(BIN)/python benchmarks/codec.py
	$(BIN)/python benchmarks/export_runtimes.py --threads 1
	$(BIN)/python benchmarks/transport.py

clean-venv:
	rm -rf $(VENV)

# the PFLlib-protocol table of docs/results/bench-fmnist.md: every method at lr 0.005 x 3 seeds (about
# 90 minutes on 2 cores); resumable
.PHONY: bench-table
bench-table: apt-data $(VENV)/.stamp-main
	$(BIN)/flayer bench --dataset fmnist --partition dir0.1 --clients 20 --samples 12000 --rounds 50 --lr 0.005 \
	    --seeds 0,1,2 --methods all --jobs 2 --out runs/bench-fmnist

# the fair comparison (docs/results/bench-fmnist.md): each method's learning rate chosen on validation
# accuracy (flayer tune, one seed), then every method at its choice over 3 seeds, the top methods on all
# 70,000 images, and the ablation at the tuned rates; all resumable
TUNE_ARGS = --dataset fmnist --partition dir0.1 --clients 20 --samples 12000 --rounds 30 --seed 0 --jobs 2 \
	--methods flayer,flayer-ref,local,lgfedavg,fedala,fedper,ditto,fedrep,fedbabu,playerfl,fedavg
TUNED = docs/results/tune-fmnist/tuned.json
.PHONY: tune-table tuned-table full-table ablation-table async-table
tune-table: apt-data $(VENV)/.stamp-main
	$(BIN)/flayer tune $(TUNE_ARGS) --lrs 0.005,0.01,0.02,0.05,0.1,0.2 --out docs/results/tune-fmnist
tuned-table: tune-table
	$(BIN)/flayer bench $(TUNE_ARGS) --seeds 0,1,2 --target 0.94 --tuned $(TUNED) \
	    --out docs/results/tuned-fmnist
full-table: tune-table
	$(BIN)/flayer bench --dataset fmnist --partition dir0.1 --clients 20 --rounds 30 --seed 0 --jobs 2 \
	    --methods flayer,flayer-ref,fedala,fedper,fedrep,local --seeds 0,1,2 --target 0.95 --tuned $(TUNED) \
	    --tuned-pick stable \
	    --out docs/results/full-fmnist
ablation-table: tuned-table
	$(BIN)/flayer ablate --dataset fmnist --partition dir0.1 --clients 20 --samples 12000 --rounds 30 --seed 0 \
	    --seeds 0,1,2 --tuned $(TUNED) --jobs 2 --reuse docs/results/tuned-fmnist --out docs/results/ablation-fmnist

# docs/explanation/async-rounds.md: the demo fleet, synchronous vs asynchronous rounds on a simulated clock
async-table: apt-data apt-broker $(VENV)/.stamp-main
	$(BIN)/python benchmarks/async_rounds.py --out docs/results/async-demo --emulator

# docs/results/thin-links.md: accuracy against bytes (3 seeds, simulated) and the demo fleet on the real emulator
.PHONY: thin-table
thin-table: apt-data apt-broker $(VENV)/.stamp-main
	$(BIN)/python benchmarks/thin_links.py --seeds 0,1,2 --rounds 15 --samples 6000 --clients 20 --lr 0.05 \
	    --keep 0.15 --out docs/results/thin-links
	$(BIN)/python benchmarks/thin_demo.py --out docs/results/thin-demo
