#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to run the sweeps through SLURM without a cluster (README, "Running on
# a cluster"; tests/test_slurm.py).
#
#   bash scripts/slurm_local.sh start [DIR]    install Debian's packages if missing, write the configs for this
#                                             machine, start the daemons, wait until the node is idle
#   bash scripts/slurm_local.sh stop [DIR]     cancel the cluster's jobs, stop the daemons `start` started
#   bash scripts/slurm_local.sh status [DIR]   exit status 0 when the cluster this script started is up
#
# DIR (default: $SLURM_LOCAL_DIR, else the running cluster's, named in its config, else /tmp/slurm-local)
# holds the cluster's state, logs (DIR/log), job database (DIR/db) and the ids of the processes it started
# (DIR/pids); `stop` ends those processes by these ids, and nothing else. The config goes to $SLURM_CONF (default
# /etc/slurm/slurm.conf, where sbatch and sinfo look), slurmdbd.conf beside it; a config there that this script did
# not write is never replaced.
# Daemons, as root and without systemd: munged (authentication; one already running is used and left alone),
# mariadbd + slurmdbd (job accounting: the SLURM launcher, submitit, reads a job's end state with sacct, so without
# it a cancelled or failed job would be waited for forever), slurmctld (the controller) and slurmd (one node with all
# of this machine's cores and memory; ProctrackType=proctrack/linuxproc, TaskPlugin=task/none: no cgroups). Ports
# 6817-6820 on 127.0.0.1 (slurmctld, slurmd, slurmdbd, mariadbd). Starting again while it runs does nothing.
# Exit status: 0 done; 1 it could not start (one `error:` line naming the log); 3 this machine cannot host it (the
# packages are missing and cannot be installed, or not root): tests skip on 3.
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin

PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
COMMANDS=(munged slurmctld slurmd sinfo sbatch sacct slurmdbd mariadbd mariadb-install-db)
MARKER="# written by kvpress-research scripts/slurm_local.sh; state:"
CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
export SLURM_CONF=$CONF
DB_PORT=6820

die() { # die STATUS MESSAGE: one line on stderr
    echo "error: slurm_local.sh: $2" >&2
    exit "$1"
}

conf_dir_of() { # the state directory named in this script's config, if that config exists
    [ -f "$CONF" ] && sed -n "s|^$MARKER ||p" "$CONF" | head -n 1
}

running_dir() { # the state directory of the cluster this script started and that runs now, if any
    local dir
    dir=$(conf_dir_of)
    [ -n "$dir" ] && [ -s "$dir/pids/slurmctld.pid" ] && kill -0 "$(cat "$dir/pids/slurmctld.pid")" 2>/dev/null &&
        echo "$dir"
}

ACTION=${1:-}
DIR=${2:-${SLURM_LOCAL_DIR:-$(running_dir)}}
DIR=${DIR:-/tmp/slurm-local}
case "$DIR" in /*) ;; *) DIR=$PWD/$DIR ;; esac
PIDS=$DIR/pids
LOG=$DIR/log

alive() { [ -s "$PIDS/$1.pid" ] && kill -0 "$(cat "$PIDS/$1.pid")" 2>/dev/null; }

node_state() { timeout 10 sinfo -h -N -o %t 2>/dev/null | head -n 1; }

node_ready() { [[ "$(node_state)" =~ ^(idle|mix|alloc)$ ]]; }

is_up() { # the controller and node this script started answer
    alive slurmctld && alive slurmd && [ -n "$(node_state)" ]
}

last_error() { # the last error line of a log, or its last line
    local line
    line=$(grep -E -i "error|fatal" "$1" 2>/dev/null | tail -n 1)
    echo "${line:-$(tail -n 1 "$1" 2>/dev/null)}"
}

launch() { # launch NAME COMMAND...: run a daemon in the foreground of its own session, record its process id
    local name=$1
    shift
    setsid "$@" >>"$LOG/$name.out" 2>&1 </dev/null &
    echo $! >"$PIDS/$name.pid"
}

wait_for() { # wait_for NAME SECONDS COMMAND...: until COMMAND succeeds, while NAME's process lives
    local name=$1 seconds=$2 i
    shift 2
    for ((i = 0; i < seconds * 4; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        alive "$name" || fail "$name exited at start: $(last_error "$LOG/$name.out") (logs: $LOG)"
        sleep 0.25
    done
    fail "$name did not answer within ${seconds}s: $(last_error "$LOG/$name.out") (logs: $LOG)"
}

fail() { # stop what this call started, then one error line
    stop_daemons >/dev/null 2>&1
    die 1 "$1"
}

install_packages() {
    local missing=() c
    for c in "${COMMANDS[@]}"; do command -v "$c" >/dev/null 2>&1 || missing+=("$c"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die 3 "${missing[*]} missing and installing ${PACKAGES[*]} needs root"
    command -v apt-get >/dev/null 2>&1 || die 3 "${missing[*]} missing and there is no apt-get to install ${PACKAGES[*]}"
    mkdir -p "$LOG"
    echo "slurm_local: installing ${PACKAGES[*]} (log: $LOG/apt.log)"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"; } \
        >"$LOG/apt.log" 2>&1 || die 3 "apt-get could not install ${PACKAGES[*]}: $(last_error "$LOG/apt.log")"
}

write_configs() { # this machine's node: its short hostname, cores (nproc) and memory (what slurmd measures)
    local node cpus mem dbpass
    if [ -f "$CONF" ] && ! grep -q "^$MARKER" "$CONF"; then
        die 1 "$CONF exists and was not written by this script; set SLURM_CONF=<another path> to leave it alone"
    fi
    node=$(hostname -s)
    cpus=$(nproc)
    mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [ -n "$mem" ] || mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    mkdir -p "$(dirname "$CONF")" "$DIR/ctld" "$DIR/slurmd" "$DIR/db"
    cat >"$CONF" <<EOF || die 1 "cannot write $CONF"
$MARKER $DIR
ClusterName=local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    [ -s "$DIR/db/password" ] || (umask 077 && od -An -N12 -tx1 /dev/urandom | tr -d ' \n' >"$DIR/db/password")
    dbpass=$(cat "$DIR/db/password")
    (umask 077 && cat >"$(dirname "$CONF")/slurmdbd.conf" <<EOF
$MARKER $DIR
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$dbpass
StorageLoc=slurm_acct_db
EOF
    )
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    munge_works && return 0 # a munged of this machine (ours, or one we leave alone)
    mkdir -p /run/munge
    chown munge:munge /run/munge
    [ -s /etc/munge/munge.key ] || setpriv --reuid=munge --regid=munge --init-groups mungekey --create >/dev/null 2>&1
    launch munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
    wait_for munged 15 munge_works
}

sql() { mariadb --no-defaults --socket="$DIR/db/mysqld.sock" -u root -e "$1"; }

start_database() {
    local dbpass
    if [ ! -d "$DIR/db/data/mysql" ]; then
        mariadb-install-db --no-defaults --datadir="$DIR/db/data" --user=root --auth-root-authentication-method=socket \
            --skip-test-db >"$LOG/mariadb-install.out" 2>&1 ||
            fail "mariadb-install-db failed: $(last_error "$LOG/mariadb-install.out") (logs: $LOG)"
    fi
    launch mariadbd mariadbd --no-defaults --datadir="$DIR/db/data" --socket="$DIR/db/mysqld.sock" --port=$DB_PORT \
        --bind-address=127.0.0.1 --user=root --pid-file="$DIR/db/mariadbd.pid" --log-error="$LOG/mariadb.log" \
        --innodb-lock-wait-timeout=900
    wait_for mariadbd 60 sql "SELECT 1"
    dbpass=$(cat "$DIR/db/password")
    sql "CREATE OR REPLACE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$dbpass';
         GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" >>"$LOG/mariadbd.out" 2>&1 ||
        fail "could not create the accounting database user (logs: $LOG)"
}

stop_daemons() { # newest first; TERM, then KILL after 15 s
    local name pid i
    for name in slurmd slurmctld slurmdbd mariadbd munged; do
        alive "$name" || { rm -f "$PIDS/$name.pid"; continue; }
        pid=$(cat "$PIDS/$name.pid")
        kill -TERM "$pid" 2>/dev/null
        for ((i = 0; i < 60; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
        rm -f "$PIDS/$name.pid"
        echo "slurm_local: stopped $name ($pid)"
    done
}

queue_empty() { [ -z "$(timeout 10 squeue -h -o %A 2>/dev/null)" ]; }

# Cancel the cluster's queued and running jobs, after 15 s for those ending (a sweep returns once its jobs have
# written their results, before their processes exit; the runs of cancelled jobs resume when resubmitted); then wait
# until every job has left the queue.
cancel_jobs() {
    local jobs i
    queue_empty && return 0
    echo "slurm_local: waiting up to 15 s for the jobs in the queue to end"
    for ((i = 0; i < 60; i++)); do queue_empty && return 0; sleep 0.25; done
    jobs=$(timeout 10 squeue -h -t PENDING,RUNNING,SUSPENDED -o %A 2>/dev/null | sort -u)
    if [ -n "$jobs" ]; then
        echo "slurm_local: cancelling jobs ${jobs//$'\n'/ }"
        # shellcheck disable=SC2086  # one argument per job id
        scancel $jobs 2>/dev/null
    fi
    for ((i = 0; i < 120; i++)); do queue_empty && break; sleep 0.25; done
}

case "$ACTION" in
start)
    if is_up; then
        echo "slurm_local: running (state in $DIR; node $(node_state))"
        exit 0
    fi
    running=$(running_dir)
    if [ -n "$running" ] && [ "$running" != "$DIR" ]; then
        die 1 "a cluster of this script runs from $running; stop it first (bash scripts/slurm_local.sh stop)"
    fi
    install_packages
    [ "$(id -u)" -eq 0 ] || die 3 "starting the SLURM daemons needs root"
    mkdir -p "$PIDS" "$LOG"
    stop_daemons >/dev/null 2>&1 # leftovers of a half-started cluster in DIR
    write_configs
    start_munge
    start_database
    launch slurmdbd slurmdbd -D
    wait_for slurmdbd 60 timeout 10 sacctmgr -n list cluster
    launch slurmctld slurmctld -D
    wait_for slurmctld 60 timeout 10 sinfo -h
    launch slurmd slurmd -D -N "$(hostname -s)"
    wait_for slurmd 60 node_ready
    echo "slurm_local: running (state in $DIR; node $(hostname -s): $(nproc) CPUs, $(node_state))"
    ;;
stop)
    is_up && cancel_jobs
    stop_daemons
    ;;
status)
    if is_up; then
        echo "slurm_local: running (state in $DIR; node $(node_state))"
    else
        echo "slurm_local: not running (state in $DIR)"
        exit 1
    fi
    ;;
*)
    echo "usage: bash scripts/slurm_local.sh start|stop|status [DIR]" >&2
    exit 2
    ;;
esac
