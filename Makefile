# kvmesh: two commands set everything up on a fresh Debian machine.
#   make run   install what is missing, prepare SmolLM2, serve the mesh (kvmesh up)
#   make test  install what is missing, then run the test suite
# Both are idempotent: each step is skipped when its result is already there.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_HASH := $(shell cat requirements.txt requirements-nodeps.txt pyproject.toml | sha1sum | cut -c1-12)
STAMP := $(VENV)/.deps-$(DEPS_HASH)
PYTEST_ARGS ?=
export VLLM_HOST_IP := 127.0.0.1
export UCX_NET_DEVICES := lo
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1

MC_VENV ?= .mcvenv
SGL_VENV ?= .sglvenv
SGL_PY := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.deps-$(shell cat requirements-sglang.txt | sha1sum | cut -c1-12)
MOONCAKE ?= mooncake-transfer-engine-non-cuda==0.3.13.post1

.PHONY: run test setup system-deps venv model lint typecheck protos clean-venv bench-store-mooncake sglang

run: setup model
	$(VENV)/bin/kvmesh up $(ARGS)

test: setup model
	$(PY) -m pytest $(PYTEST_ARGS)

setup: system-deps venv

system-deps:
	@missing=""; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v kubectl >/dev/null 2>&1 || missing="$$missing kubernetes-client"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	  for svc in etcd redis-server; do (command -v service >/dev/null && $$SUDO service $$svc stop) >/dev/null 2>&1 || true; done; \
	fi

venv: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	$(PIP) install -q -r requirements.txt
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.deps-*
	touch $@

model: venv
	$(PY) -m workers.model.prepare

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

protos: venv
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto

# The store benchmark with the real Mooncake Store beside ours, in one run. Mooncake lives in
# a venv of its own ($(MC_VENV)): it is not a kvmesh requirement. It needs libibverbs1.
bench-store-mooncake: setup model
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libibverbs1; }
	test -x $(MC_VENV)/bin/python || $(PYTHON) -m venv $(MC_VENV)
	$(MC_VENV)/bin/python -c "import mooncake.store, numpy" 2>/dev/null || \
	  $(MC_VENV)/bin/python -m pip install -q "$(MOONCAKE)" numpy
	$(PY) -m bench.store --mooncake-python $(MC_VENV)/bin/python $(ARGS)

# The SGLang 0.5.23 CPU runtime in a venv of its own ($(SGL_VENV)): SGLang pins torch, tokenizers
# and openai versions that clash with .venv's. A .pth makes .venv's site-packages (torch 2.13.0+cpu,
# nixl, transformers, ...) visible AFTER $(SGL_VENV)'s own, so requirements-sglang.txt's pins win.
sglang: venv $(SGL_STAMP)

$(SGL_STAMP): requirements-sglang.txt $(STAMP)
	test -x $(SGL_PY) || $(PYTHON) -m venv $(SGL_VENV)
	$(PY) -c 'import torch, nixl'
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > "$$($(SGL_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvmesh-venv.pth"
	$(SGL_PY) -m pip install -q --no-deps -r requirements-sglang.txt
	$(SGL_PY) -c 'import tokenizers, openai, torch, nixl, importlib.metadata as m; \
	  assert tokenizers.__version__ == "0.23.2" and openai.__version__ == "2.8.0", (tokenizers.__file__, openai.__file__); \
	  assert torch.__version__ == "2.13.0+cpu", torch.__version__; assert m.version("sglang") == "0.5.23"'
	rm -f $(SGL_VENV)/.deps-*
	touch $@

clean-venv:
	rm -rf $(VENV)
