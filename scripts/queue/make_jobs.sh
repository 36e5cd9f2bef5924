#!/usr/bin/env bash
# Writes $Q/jobs.txt: name|command|glob of its shard directories under $OUT|how many; one half of one shard per job:
# the jobs of the 4k / 8k real-text grids (results/.staging/README.md, whose done.txt lists them all as done).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
D4="dataset=stdlib_docs dataset.context_lengths=[4096] n_samples=50"
R="ratios=[0.25,0.5,0.75]"
M=smollm2-135m
gA() { echo "$1/$M/{${PA}}/cr*/shard_$2"; }
gB() { echo "$1/$M/{${PB},snis_min_h_page}/cr*/shard_$2"; }
{
# one protocol whole before the next: a stop leaves the most finished grid
for i in $(seq 0 19); do
  S="shard=$i/20 output_dir=\$OUT/4k"
  echo "docs4k_inside_A_s$i|\$PY -m evaluation.fused $D4 query_aware=true \"presses=[$PA]\" \"$R\" $S|$(gA 4k/stdlib_docs-qa ${i}_of_20)|28"
  echo "docs4k_inside_B_s$i|\$PY -m evaluation.fused $D4 query_aware=true \"presses=[$PB,snis_min_h_page]\" \"$R\" $S|$(gB 4k/stdlib_docs-qa ${i}_of_20)|30"
done
# Finch (inside only) next, so the inside protocol is whole before the after grid starts
for i in 0 1 2 3; do
  echo "docs4k_finch_s$i|\$PY -m evaluation.run -m $D4 query_aware=true press=finch compression_ratio=0.25,0.5,0.75 shard=$i/4 output_dir=\$OUT/4k|4k/stdlib_docs-qa/$M/finch/cr*/shard_${i}_of_4|3"
done
for i in $(seq 0 19); do
  S="shard=$i/20 output_dir=\$OUT/4k"
  echo "docs4k_after_A_s$i|\$PY -m evaluation.fused $D4 \"presses=[$PA]\" \"$R\" $S|$(gA 4k/stdlib_docs ${i}_of_20)|28"
  echo "docs4k_after_B_s$i|\$PY -m evaluation.fused $D4 \"presses=[$PB]\" \"$R\" $S && \$PY -m evaluation.fused $D4 \"presses=[snis_min_h_page]\" \"ratios=[0.25,0.5]\" $S && \$PY -m evaluation.fused $D4 \"presses=[snis_min_h_page]\" ++press.draws=sequential \"ratios=[0.75]\" $S|$(gB 4k/stdlib_docs ${i}_of_20)|30"
done
C="dataset=continuation_loss dataset.context_lengths=[4096] n_samples=25"
for i in $(seq 0 9); do
  S="shard=$i/10 output_dir=\$OUT/4k"
  echo "cont4k_A_s$i|\$PY -m evaluation.fused $C \"presses=[$PA]\" \"$R\" $S|$(gA 4k/continuation_loss ${i}_of_10)|28"
  echo "cont4k_B_s$i|\$PY -m evaluation.fused $C \"presses=[$PB]\" \"$R\" $S && \$PY -m evaluation.fused $C \"presses=[snis_min_h_page]\" \"ratios=[0.25,0.5]\" $S && \$PY -m evaluation.fused $C \"presses=[snis_min_h_page]\" ++press.draws=sequential \"ratios=[0.75]\" $S|$(gB 4k/continuation_loss ${i}_of_10)|30"
done
# 8k: each half would hold about twice the 4k's 6 GB, so quarters (one more prefill per example each)
C="dataset=continuation_loss dataset.context_lengths=[7680] n_samples=25"
g() { echo "8k/continuation_loss/$M/{$1}/cr*/shard_$2"; }
for i in $(seq 0 9); do
  S="shard=$i/10 output_dir=\$OUT/8k"
  echo "cont8k_A1_s$i|\$PY -m evaluation.fused $C \"presses=[$QA1]\" \"$R\" $S|$(g $QA1 ${i}_of_10)|10"
  echo "cont8k_A2_s$i|\$PY -m evaluation.fused $C \"presses=[$QA2]\" \"$R\" $S|$(g $QA2 ${i}_of_10)|18"
  echo "cont8k_B1_s$i|\$PY -m evaluation.fused $C \"presses=[$QB1]\" \"$R\" $S|$(g $QB1 ${i}_of_10)|15"
  echo "cont8k_B2_s$i|\$PY -m evaluation.fused $C \"presses=[$QB2]\" \"$R\" $S && \$PY -m evaluation.fused $C \"presses=[snis_min_h_page]\" \"ratios=[0.25,0.5]\" $S && \$PY -m evaluation.fused $C \"presses=[snis_min_h_page]\" ++press.draws=sequential \"ratios=[0.75]\" $S|$(g $QB2,snis_min_h_page ${i}_of_10)|15"
done
} > $Q/jobs.txt
wc -l $Q/jobs.txt
