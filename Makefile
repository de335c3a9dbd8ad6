# make demo   -- set up (once) and run the block check on NPROC ranks (gloo on CPU unless GPUs are there)
# make test   -- set up (once) and run the test suite
# make serve  -- set up (once) and serve requests on SERVE_NPROC ranks, checked against the dense oracle
# make model  -- set up (once) and train the default model and its draft on this Python's stdlib (11 minutes on 2 cores)
# make bench  -- every benchmark, then docs/benchmarks.md
# make gpu-check -- on a GPU node: NCCL runs, GPU-marked tests, bench_tp; one summary (skips without GPUs)
# make docs-check -- every quick command of the README and docs/, run as written, its verdict beside the page's
VENV    ?= .venv
PYTHON  ?= python3
NPROC   ?= 8
SERVE_NPROC ?= 4
ARGS    ?=
MODEL_DIR ?= models/stdlib
TORCH_VERSION ?= 2.13.0
PY      := $(VENV)/bin/python

.PHONY: setup demo serve test model bench gpu-check docs-check clean

setup: $(VENV)/.installed

# torch goes in first, so that the project's own install finds it and pulls nothing bigger:
#  - a machine with an NVIDIA driver gets the default (CUDA) build;
#  - otherwise a CPU wheel already on disk (pip's find-links) if there is one,
#  - else the CPU build from PyTorch's CPU-only index. A CUDA build is never downloaded without a GPU.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	elif $(PY) -m pip install --no-index --no-deps "torch==$(TORCH_VERSION)" >/dev/null 2>&1; then \
	  echo "torch $(TORCH_VERSION): local CPU wheel"; $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	else \
	  $(PY) -m pip install "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PY) -m pip install -q -e ".[test,hf,api,train]"
	touch $@

demo: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) launch/run_block.py $(ARGS)

serve: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(SERVE_NPROC) launch/serve.py $(ARGS)

# Two pytest workers, a test file each at a time (its module fixtures start once): many tests wait on rank
# processes, so two files at once keep both cores busy.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

# The model the docs and benchmarks use (train/; ignored by git): once, then `make model` finds it there.
model: setup $(MODEL_DIR)/model.safetensors $(MODEL_DIR)-draft/model.safetensors

$(MODEL_DIR)/model.safetensors:
	$(PY) -m train --output-dir $(MODEL_DIR) $(ARGS)

$(MODEL_DIR)-draft/model.safetensors: $(MODEL_DIR)/model.safetensors
	$(PY) -m train --output-dir $(MODEL_DIR)-draft --size draft --tokenizer $(MODEL_DIR) $(ARGS)

# Every benchmark (about 25 minutes on 2 cores), then docs/benchmarks.md from their JSON. bench_spec_decode.py
# measures on the trained model: `make model` first (about 11 minutes, once).
bench: setup model
	$(PY) -m pip install -q -e ".[plot]"
	$(PY) benchmarks/bench_tp.py
	for p in 2 8; do $(VENV)/bin/torchrun --standalone --nproc_per_node=$$p benchmarks/bench_ledger.py --out outputs/bench_ledger_p$$p.json; done
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 benchmarks/bench_varlen.py
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 benchmarks/profile_forward.py
	$(PY) launch/traffic_sweep.py
	for p in 1 2; do $(VENV)/bin/torchrun --standalone --nproc_per_node=$$p benchmarks/bench_serve.py; done
	$(VENV)/bin/torchrun --standalone --nproc_per_node=1 benchmarks/bench_paged.py
	$(VENV)/bin/torchrun --standalone --nproc_per_node=1 benchmarks/profile_serve.py
	$(VENV)/bin/torchrun --standalone --nproc_per_node=4 benchmarks/bench_pd.py
	$(VENV)/bin/torchrun --standalone --nproc_per_node=4 benchmarks/bench_pd.py --trace 32 --out outputs/bench_pd_trace.json
	for p in 2 4; do $(VENV)/bin/torchrun --standalone --nproc_per_node=$$p benchmarks/bench_pp.py --pp $$p; done
	$(VENV)/bin/torchrun --standalone --nproc_per_node=4 benchmarks/bench_pp_serve.py
	$(VENV)/bin/torchrun --standalone --nproc_per_node=8 benchmarks/bench_kv.py
	$(PY) benchmarks/bench_load.py
	$(PY) benchmarks/bench_llm.py
	$(PY) benchmarks/bench_sampling.py
	$(PY) benchmarks/bench_kv_quant.py
	$(PY) benchmarks/bench_eviction.py
	$(PY) benchmarks/bench_spec_decode.py
	$(PY) benchmarks/bench_threads.py
	$(PY) benchmarks/bench_http.py
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_kv_tiers.py
	$(PY) benchmarks/bench_flash.py
	$(PY) benchmarks/report.py

gpu-check: setup
	$(PY) launch/gpu_check.py

# Every quick command the README and docs/ show, run as written, its verdict beside the page's (slow: not in CI).
docs-check: setup
	$(PY) launch/docs_check.py

clean:
	rm -rf $(VENV) outputs .pytest_cache *.egg-info
