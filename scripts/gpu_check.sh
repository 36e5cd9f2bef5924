#!/usr/bin/env bash
# GPU check (issue 19): the Triton kernels compiled, their benchmark, and the presses end to end, on one CUDA
# GPU, in about 5 to 8 minutes; writes results/gpu/ (README.md with the device, versions, command and tables).
#
#   bash scripts/gpu_check.sh                 # on a CUDA machine (make gpu-check)
#   bash scripts/gpu_check.sh --prepare       # here, online: download the pinned wheels into wheels/ (git-ignored)
#   bash scripts/gpu_check.sh --dry-run       # CPU plumbing check of every stage (tests/test_gpu_check.py)
#
# Options: --out DIR (default results/gpu; the dry run defaults to a new temp folder), --only STAGES
# (comma-separated subset of install,tests,bench,e2e,report, for a rerun), --budget-s S (whole run, default 470).
# Environment: GPU_CHECK_COMMIT (the commit env.txt names), PYTHON (default python3), GPU_CHECK_WHEELS (default
# wheels), GPU_CHECK_TARGET_PYTHON (the device's python for --prepare, default 3.12), GPU_CHECK_FORCE_INSTALL=1
# (install the wheels even when nothing lacks; with --dry-run, into a temp folder: a rehearsal of the install stage).
#
# Stages:
#   install  kvpress 0.5.5, transformers<5.3 (5.2.0) and hydra are needed: the presses import kvpress, whose
#            0.5.5 pins transformers<5.3 and imports its internals; the end-to-end stage builds presses from
#            the harness's Hydra configs. Where python3 lacks them, the wheels in wheels/ (made by --prepare)
#            are installed with --no-deps into /tmp/gpu_check_site, put first on PYTHONPATH (so transformers
#            5.2.0 and tokenizers 0.22.2 shadow newer ones); if the carried datasets wheel cannot import
#            there (kvpress imports it only for presses this check does not run), a stub takes its place
#            and install.txt says so.
#   tests    tests/test_kernels.py and tests/test_kernel_row_masses.py (EntroPrefill's row kernel) with
#            KVPRESS_TEST_DEVICE=cuda TRITON_INTERPRET=0: every kernel test compiled,
#            every low-precision-capable test in float32, bfloat16 and float16; the dispatch-equality tests
#            force KVPRESS_RESEARCH_KERNELS=triton themselves (on CUDA, auto picks Triton too).
#            -> kernel_tests.xml (JUnit), tests.log
#   bench    scripts/bench_kernels.py at T in {4k, 16k, 64k} -> kernels/*.csv
#   e2e      scripts/gpu_end_to_end.py: SnapKV, Page-EntroKV, probabilistic eviction, EntroPrefill on a random
#            model with SmolLM2-135M's shapes: GPU vs CPU kept sets at 4k, timings at 8k and 32k -> end_to_end/
#   report   scripts/gpu_report.py -> README.md (the goals of issue 19 checked against the numbers)
#
# On this workplace's device machine (python3 has torch, triton, transformers 5.x, pytest; no registry): run
# `bash scripts/gpu_check.sh --prepare` here first, in the checkout the device tool sends, then make ONE call:
#
#   run(command="bash scripts/gpu_check.sh", carry=["wheels"], timeout_s=540)
#
# The device tool sends at most 64 MiB of working tree, counted in disk blocks: results/ (thousands of small
# files) puts the checkout over it, and the check needs none of it but results/gpu and results/kernels. Move the
# rest aside for the call and back after it (as the runs of 2026-12-04 did), with nothing uncommitted in results/
# and no job writing there (git sees results/ as deleted meanwhile: commit nothing until it is back):
#   git diff --quiet -- results && [ -z "$(git ls-files -o --exclude-standard results)" ] || echo "commit first"
#   H=$(mktemp -d) && mv results "$H/" && mkdir results && cp -a "$H"/results/{gpu,kernels} results/
#   run(command="GPU_CHECK_COMMIT=<git rev-parse --short HEAD> bash scripts/gpu_check.sh", carry=["wheels"], ...)
#   mv results "$H/sent" && mv "$H/results" results     # then unpack (below), check git status, rm -rf "$H"
# What it leaves in $OUT: results_gpu.tar.gz (all of results/gpu, refreshed after every stage, so a timeout
# still returns the stages done), README.md and gpu_check.log. Unpack: tar xzf <files_at>/results_gpu.tar.gz -C results/
# A rerun of some stages (the install stage always runs first): --only bench,e2e,report.
set -uo pipefail

ARGS="$*"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
MODE=gpu
OUT_DIR=""
ONLY="install,tests,bench,e2e,report"  # = ALL_STAGES below
BUDGET_S=470
# --prepare: the wheels the device machine lacks, pinned (the versions the project's tests run on); the last two
# exist only as source distributions and are built here into pure-python wheels
BINARY_WHEELS=(kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 hydra-core==1.3.8 omegaconf==2.3.1
               cachetools==5.5.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 termcolor==3.3.0)
SOURCE_WHEELS=(antlr4-python3-runtime==4.9.3 fire==0.6.0)
TARGET_PYTHON="${GPU_CHECK_TARGET_PYTHON:-3.12}"  # the device machine's python3
WHEELS="${GPU_CHECK_WHEELS:-wheels}"  # where --prepare puts the wheels and the install stage reads them
MAX_WHEEL_MB=60
RESERVE=25  # seconds of the budget kept for the report stage

while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare ;;
    --dry-run) MODE=dry-run ;;
    --out) OUT_DIR="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --budget-s) BUDGET_S="$2"; shift ;;
    -h|--help) sed -n '2,48p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# ------------------------------------------------------------------------------------------------ --prepare
if [ "$MODE" = prepare ]; then
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl
  plat=(--python-version "$TARGET_PYTHON" --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux1_x86_64)
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$WHEELS" "${BINARY_WHEELS[@]}" || exit 1
  "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "${SOURCE_WHEELS[@]}" || exit 1
  (cd "$WHEELS" && ls -l *.whl && sha256sum *.whl > SHA256SUMS)
  mb=$(du -cm "$WHEELS"/*.whl | tail -1 | cut -f1)
  echo "$WHEELS/: $(ls "$WHEELS"/*.whl | wc -l) wheels, ${mb} MiB (limit ${MAX_WHEEL_MB} MiB)"
  [ "$mb" -le "$MAX_WHEEL_MB" ] || { echo "$WHEELS/ is over ${MAX_WHEEL_MB} MiB" >&2; exit 1; }
  exit 0
fi

# ------------------------------------------------------------------------------------------------ setup
if [ -z "$OUT_DIR" ]; then
  if [ "$MODE" = dry-run ]; then OUT_DIR="$(mktemp -d)/gpu"; else OUT_DIR="results/gpu"; fi
fi
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
ALL_STAGES="install,tests,bench,e2e,report"
if [ "$ONLY" = "$ALL_STAGES" ]; then  # a full run: no stale file of an earlier run may stay
  rm -rf "$OUT_DIR/kernels" "$OUT_DIR/end_to_end"
  rm -f "$OUT_DIR"/{README.md,stages.csv,install.txt,env.txt,kernel_tests.xml,gpu_check.log} "$OUT_DIR"/*.log
fi
[ -f "$OUT_DIR/stages.csv" ] || echo "stage,rc,seconds" > "$OUT_DIR/stages.csv"
for st in install ${ONLY//,/ }; do  # a partial rerun replaces the rows of the stages it reruns
  grep -v "^$st," "$OUT_DIR/stages.csv" > "$OUT_DIR/stages.tmp"; mv "$OUT_DIR/stages.tmp" "$OUT_DIR/stages.csv"
done
echo "--- $(date -u +%Y-%m-%dT%H:%M:%SZ) bash scripts/gpu_check.sh $ARGS" >> "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START=$(date +%s)
FAILED=0
COMMAND="bash scripts/gpu_check.sh${ARGS:+ $ARGS}"
log() { echo "[gpu_check $(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
want() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# copy what exists to the device tool's $OUT (no more than 8 files come back): after every stage
export_out() {
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] || return 0
  tar czf "$OUT/results_gpu.tar.gz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" 2>/dev/null
  cp -f "$LOG" "$OUT/gpu_check.log" 2>/dev/null
  [ -f "$OUT_DIR/README.md" ] && cp -f "$OUT_DIR/README.md" "$OUT/README.md"
  return 0
}

# run_stage NAME CAP_SECONDS CMD...: runs under a timeout of min(CAP, what is left of the budget - RESERVE),
# records rc and seconds in stages.csv, writes the output to NAME.log and the log
run_stage() {
  local name="$1" cap="$2"; shift 2
  local limit t0 rc
  limit=$(( $(left) - RESERVE ))
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt 20 ]; then
    log "$name: skipped, ${limit}s left of the ${BUDGET_S}s budget"
    echo "$name,skipped,0" >> "$OUT_DIR/stages.csv"; FAILED=1; return 1
  fi
  log "$name: start (timeout ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "$name,$rc,$(( $(date +%s) - t0 ))" >> "$OUT_DIR/stages.csv"
  log "$name: exit $rc after $(( $(date +%s) - t0 ))s"
  [ "$rc" -ne 0 ] && FAILED=1
  export_out
  return "$rc"
}

# ------------------------------------------------------------------------------------------------ install
# What python3 lacks of kvpress 0.5.5 / transformers<5.3 / hydra / omegaconf ("NEED: ..." lines; none: nothing),
# and where each package imports from ("IMPORT: ..." lines; not with the argument "versions", for the dry run:
# importing kvpress costs seconds, and the later stages import it anyway)
probe() {
  "$PY" - "${1:-imports}" <<'EOF'
import importlib, importlib.metadata as md, sys
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
need = []
if ver("kvpress") != "0.5.5":
    need.append(f"kvpress {ver('kvpress')} (needs 0.5.5)")
tv = ver("transformers")
if tv is None or tuple(int(x) for x in tv.split(".")[:2]) >= (5, 3):
    need.append(f"transformers {tv} (kvpress 0.5.5 needs <5.3)")
for name in ("hydra-core", "omegaconf"):
    if ver(name) is None:
        need.append(f"{name} missing")
for mod, dist in (("transformers", "transformers"), ("tokenizers", "tokenizers"), ("kvpress", "kvpress"),
                  ("hydra", "hydra-core"), ("omegaconf", "omegaconf"), ("datasets", "datasets")):
    if sys.argv[1] == "versions":
        print(f"VERSION: {dist} {ver(dist)}")
        continue
    try:
        m = importlib.import_module(mod)
        print(f"IMPORT: {dist} {ver(dist)} from {m.__file__}")
    except Exception as err:
        print(f"IMPORT: {dist} {ver(dist)} FAILED: {type(err).__name__}: {err}")
        if mod != "datasets":  # kvpress imports datasets: its failure shows up under kvpress
            need.append(f"import {mod}: {type(err).__name__}: {err}")
print("\n".join(f"NEED: {n}" for n in need))
EOF
}

# writes its report to stdout; exports PYTHONPATH (so it must not run in a subshell)
stage_install() {
  local site=/tmp/gpu_check_site need report
  {
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
    report="$(probe "$([ "$MODE" = dry-run ] && [ -z "${GPU_CHECK_FORCE_INSTALL:-}" ] && echo versions)")"
    need="$(grep '^NEED: ' <<< "$report")"
    if [ -z "$need" ] && [ -z "${GPU_CHECK_FORCE_INSTALL:-}" ]; then
      echo "nothing to install: kvpress 0.5.5, transformers<5.3, hydra and omegaconf are there"
    elif [ "$MODE" = dry-run ] && [ -z "${GPU_CHECK_FORCE_INSTALL:-}" ]; then
      echo "dry run: would install the wheels of $WHEELS/ because:"; echo "$need"
    else
      echo "installing $WHEELS/*.whl because:"; echo "${need:-GPU_CHECK_FORCE_INSTALL is set}"
      ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no $WHEELS/*.whl: run 'bash scripts/gpu_check.sh --prepare'" \
        "where pip reaches PyPI, and carry $WHEELS/"; return 1; }
      [ "$MODE" = dry-run ] && site="$(mktemp -d)/site"  # a rehearsal: never touch /tmp/gpu_check_site here
      rm -rf "$site"
      local extra=()
      # off the target python (a dry-run rehearsal here), install for it anyway: pure files, no build
      [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$TARGET_PYTHON" ] && \
        extra=(--python-version "$TARGET_PYTHON" --only-binary=:all: --platform manylinux_2_17_x86_64)
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${extra[@]}" "$WHEELS"/*.whl || return 1
      export PYTHONPATH="$site:$PYTHONPATH"
      if ! "$PY" -c "import datasets" >/dev/null 2>&1; then
        local err
        err="$("$PY" -c "import datasets" 2>&1 | tail -1)"
        mkdir -p "$site/datasets"
        cat > "$site/datasets/__init__.py" <<EOF
"""Stub written by scripts/gpu_check.sh: the carried datasets wheel does not import here ($err).
kvpress imports load_dataset only for DuoAttention / expected-attention statistics, which this check does not run."""


def load_dataset(*args, **kwargs):
    raise ImportError("datasets is a stub on this machine (scripts/gpu_check.sh)")
EOF
        echo "datasets STUBBED: the carried wheel does not import here: $err"
      fi
      report="$(probe)"
      need="$(grep '^NEED: ' <<< "$report")"
      [ -z "$need" ] || { echo "$report"; echo "still missing after the install"; return 1; }
      echo "installed into $site (first on PYTHONPATH):"; ls "$WHEELS"/*.whl
    fi
    echo "$report"
  } 2>&1
}

env_info() {
  {
    if [ "$MODE" = dry-run ]; then echo "dry run: no device"; echo "nproc: $(nproc)"; return 0; fi
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if [ -n "${GPU_CHECK_COMMIT:-}" ]; then  # the caller's commit (the device tool's copy may carry another .git)
      echo "git: $GPU_CHECK_COMMIT (GPU_CHECK_COMMIT, given by the caller)"
    else
      echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo -) $(git status --porcelain 2>/dev/null | wc -l) changed files"
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory \
      --format=csv 2>&1
    "$PY" -c 'import torch, triton, platform; print("python", platform.python_version(), "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "device",
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1
    echo "nproc: $(nproc)"
  } > "$OUT_DIR/env.txt"
}

log "mode $MODE, out $OUT_DIR, stages $ONLY, budget ${BUDGET_S}s, python $PY"
if [ "$MODE" = gpu ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  log "no CUDA device visible to $PY: use --dry-run for the CPU plumbing check"; exit 2
fi
# the install stage always runs: later stages need its PYTHONPATH
t0=$(date +%s)
log "install: start"
stage_install > "$OUT_DIR/install.txt"
rc=$?
tee -a "$LOG" < "$OUT_DIR/install.txt"
echo "install,$rc,$(( $(date +%s) - t0 ))" >> "$OUT_DIR/stages.csv"
[ "$rc" -ne 0 ] && { FAILED=1; log "install failed (rc $rc): later stages will likely fail; see install.txt"; }
env_info
export_out

# ------------------------------------------------------------------------------------------------ stages
if want tests; then
  plugins=()  # four workers compile in parallel; a per-test timeout guards a hang (when the plugins exist)
  "$PY" -c "import xdist" 2>/dev/null && plugins+=(-n 4 --dist load)
  "$PY" -c "import pytest_timeout" 2>/dev/null && plugins+=(--timeout 240)
  if [ "$MODE" = gpu ]; then
    run_stage tests 200 env KVPRESS_TEST_DEVICE=cuda TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
      "${plugins[@]}" -rfEs --junitxml="$OUT_DIR/kernel_tests.xml" tests/test_kernels.py tests/test_kernel_row_masses.py
  else  # interpreted, a fast subset: the stage's plumbing (JUnit, summary), not the kernels (make test has them)
    run_stage tests 120 env KVPRESS_TEST_DEVICE=cpu TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider \
      -rfEs --junitxml="$OUT_DIR/kernel_tests.xml" tests/test_kernels.py \
      -k "window_attention_matches_reference and float32 or kernel_mode_selection or dispatch_names"
  fi
fi
if want bench; then
  if [ "$MODE" = gpu ]; then
    b=$(( $(left) - RESERVE - 200 - 40 )); [ "$b" -gt 150 ] && b=150; [ "$b" -lt 30 ] && b=30  # leave e2e 200 s
    run_stage bench $(( b + 40 )) "$PY" scripts/bench_kernels.py --out "$OUT_DIR/kernels" --budget-s "$b"
  else
    run_stage bench 120 "$PY" scripts/bench_kernels.py --dry-run --lengths 64 --reps 1 --out "$OUT_DIR/kernels"
  fi
fi
if want e2e; then
  if [ "$MODE" = gpu ]; then
    e=$(( $(left) - RESERVE - 60 )); [ "$e" -gt 240 ] && e=240
    run_stage e2e $(( e + 60 )) "$PY" scripts/gpu_end_to_end.py --out "$OUT_DIR/end_to_end" --time-limit-s "$e"
  else
    run_stage e2e 150 "$PY" scripts/gpu_end_to_end.py --dry-run --out "$OUT_DIR/end_to_end"
  fi
fi
if want report; then
  RESERVE=0
  run_stage report 25 "$PY" scripts/gpu_report.py "$OUT_DIR" --mode "$MODE" --command "$COMMAND"
fi
log "done in $(( $(date +%s) - START ))s: $OUT_DIR $([ "$FAILED" -eq 0 ] && echo '(all stages exit 0)' || echo '(SOME STAGES FAILED: see stages.csv)')"
export_out
exit "$FAILED"
