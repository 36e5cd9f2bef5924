#!/usr/bin/env bash
# One worker of the grid queue: takes the first job of jobs.txt that is neither done (listed in the repo's
# $STAGE/done.txt) nor claimed, runs it, then copies its finished shard directories into the repo and
# commits them (under flock, so the two workers and the developer never commit at once).
# A claim is a directory claims/<job>/ whose file `owner` holds the boot id and the pid of the worker that made it.
# At its start a worker removes, under the lock, every claim of a job not in done.txt whose owner is not a live
# worker.sh of this boot (a claim of a job the last stop cut off), and a claim without an owner file (an older
# worker's) when no other worker runs; so after a stop, starting the workers again is all it takes.
# The paths ($Q, $MAIN, $STAGE, $OUT, $PY) are common.sh's; a file $Q/STOP makes every worker stop before its next job.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BOOT=$(cat /proc/sys/kernel/random/boot_id)
mkdir -p $Q/claims $Q/logs $Q/failed
WORKER='^(/usr)?(/bin/)?bash [^ ]*worker\.sh $'  # a worker's command line, NULs read as spaces
alive() {  # alive BOOT PID: that pid is a running worker.sh of this boot
  [ "$1" = "$BOOT" ] && [ -r /proc/$2/cmdline ] && tr '\0' ' ' < /proc/$2/cmdline | grep -Eq "$WORKER"
}
(
  flock 9
  others=0  # the other live workers: this one and its subshells left out
  while read -r pid ppid; do
    case " $pid $ppid " in *" $$ "* | *" $BASHPID "*) continue ;; esac
    alive "$BOOT" "$pid" && others=$((others + 1))
  done < <(ps -eo pid=,ppid=)
  for c in $(ls $Q/claims); do
    grep -qx "$c" $STAGE/done.txt 2>/dev/null && continue
    if [ -f $Q/claims/$c/owner ]; then
      read -r boot pid < $Q/claims/$c/owner
      alive "$boot" "$pid" && continue
    else
      [ "$others" -gt 0 ] && continue
    fi
    rm -rf $Q/claims/$c && echo "$(date -u +%FT%T) removed the stale claim $c ($$)" >> $Q/log.txt
  done
) 9> $Q/git.lock
while true; do
  [ -e $Q/STOP ] && { echo "$(date -u +%FT%T) STOP" >> $Q/log.txt; exit 0; }
  job=""
  while IFS='|' read -r name cmd glob count; do
    grep -qx "$name" $STAGE/done.txt 2>/dev/null && continue
    [ -e $Q/failed/$name ] && continue
    mkdir $Q/claims/$name 2>/dev/null || continue
    echo "$BOOT $$" > $Q/claims/$name/owner
    job=$name; break
  done < $Q/jobs.txt
  [ -z "$job" ] && { echo "$(date -u +%FT%T) nothing left ($$)" >> $Q/log.txt; exit 0; }
  echo "$(date -u +%FT%T) start $job ($$)" >> $Q/log.txt
  if (cd $MAIN && eval "$cmd") >> $Q/logs/$job.log 2>&1; then
    dirs=$(cd $OUT && eval ls -d $glob 2>/dev/null)
    n=$(for d in $dirs; do [ -f $OUT/$d/metrics.json ] && echo $d; done | wc -l)
    if [ "$n" != "$count" ]; then
      echo "$(date -u +%FT%T) $job: $n of $count shard dirs finished" >> $Q/log.txt; touch $Q/failed/$job; continue
    fi
    (
      flock 9
      for d in $dirs; do
        mkdir -p $STAGE/$d
        cp $OUT/$d/{config.yaml,metrics.json,predictions.jsonl,commands.txt} $STAGE/$d/ 2>/dev/null
      done
      echo "$job" >> $STAGE/done.txt
      cd $MAIN && git add -- "$STAGE" >> $Q/logs/$job.log 2>&1 \
        && git commit -q -m "Staging (issue 31): $job, $count shard runs" -- "$STAGE" >> $Q/logs/$job.log 2>&1
      echo "$(date -u +%FT%T) committed $job (rc $?)" >> $Q/log.txt
    ) 9> $Q/git.lock
  else
    echo "$(date -u +%FT%T) FAILED $job (see logs/$job.log)" >> $Q/log.txt; touch $Q/failed/$job
  fi
done
