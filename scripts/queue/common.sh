# Shared settings of the grid queue (issue 31): sourced by make_jobs.sh and worker.sh, which sit beside it (in the
# repository's scripts/queue/, or copied to the queue's directory). Every path can be given in the environment;
# the defaults are those the 4k / 8k real-text grids ran with (results/.staging/README.md).
export Q=${QUEUE_DIR:-/work/queue}             # the queue: jobs.txt, claims/, logs/, failed/, log.txt, STOP, git.lock
export MAIN=${QUEUE_REPO:-/work/main}          # the checkout that runs the jobs and commits their runs
export STAGE=${QUEUE_STAGE:-$MAIN/results/.staging}  # where finished shards are committed, with done.txt
export PY=${QUEUE_PY:-$MAIN/.venv/bin/python}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OUT=${QUEUE_OUT:-/work/grid/staging}    # the jobs' output_dir (outside the repository)
# the presses of the committed real-text grids (results/stdlib_docs*, results/continuation_loss), in two halves of
# about 29 runs each (one process of all 58 runs holds about 12 GB at 4k: two do not fit in 23 GB); the
# reconstruction presses share one pass, so they stay in one half
PA="no_press,kvzip,kvzip_plus,page_entrokv_reconstruction,page_entrokv,page_entrokv_mean,chunkkv,chunkkv32,page_entrokv_paper000,compactor"
PB="snapkv,tova,streaming_llm,expected_attention,keydiff,entropy_gated_chunkkv,knorm,snis_min_h,snis_min_page"
export PA PB
# 8k (continuation loss): quarters
QA1="no_press,kvzip,kvzip_plus,page_entrokv_reconstruction"
QA2="page_entrokv,page_entrokv_mean,chunkkv,chunkkv32,page_entrokv_paper000,compactor"
QB1="snapkv,tova,streaming_llm,expected_attention,keydiff"
QB2="entropy_gated_chunkkv,knorm,snis_min_h,snis_min_page"
export QA1 QA2 QB1 QB2
