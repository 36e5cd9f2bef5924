# Shared settings of the 4k / 8k real-text grid queue (issue 31).
export PY=/work/main/.venv/bin/python
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OUT=/work/grid/staging
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
