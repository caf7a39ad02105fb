#!/usr/bin/env bash
# A single-node SLURM on this machine for the tests (tests/test_slurm.py): munge, MariaDB + slurmdbd (so `sacct` has
# records: Slurm 22.05 has no file-based job accounting, accounting_storage/filetxt is gone), slurmctld and slurmd,
# all on 127.0.0.1. Debian's packages (slurm-wlm 22.05, slurmdbd, munge, mariadb-server); run as root.
#
#   .ci/slurm.sh start    install what is missing, write the configs, start the daemons, wait for the node (idempotent:
#                         on a cluster that already answers it does nothing)
#   .ci/slurm.sh stop     stop the daemons it started (by their pid files) and remove its state, configs and database
#   .ci/slurm.sh status   sinfo + sacct, exit 0 when the node is up
set -euo pipefail

CLUSTER=clgpt
NODE=$(hostname -s)
PARTITION=debug
STATE=/var/lib/clgpt-slurm          # everything this script creates, removed by `stop`
CONF=/etc/slurm
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

log() { echo "slurm.sh: $*" >&2; }

install_packages() {
  local missing=()
  for cmd in slurmctld slurmd slurmdbd sbatch sacct munged mariadbd; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
  done
  [ ${#missing[@]} -eq 0 ] && return
  log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # the packages' own service starts are refused in containers (policy-rc.d) and not wanted: this script starts them
  apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

cluster_up() {
  timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | grep -Eq "^$NODE (idle|mix|alloc)" \
    && timeout 10 sacctmgr -n list cluster format=cluster 2>/dev/null | grep -qw "$CLUSTER"
}

write_configs() {
  local cpus mem
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)  # leave the OS a tenth
  mkdir -p "$STATE"/{ctld,d,log,run} "$CONF"
  cat >"$CONF/slurm.conf" <<EOF
# Written by clgpt's .ci/slurm.sh (single node, for tests); \`.ci/slurm.sh stop\` removes it.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# no cgroups in a container: track job processes by their parent ids, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# cores and memory are both scheduled, so a rule's threads and mem_mb are what the job gets
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# job records for sacct come from slurmdbd (with the comment, where Snakemake's executor names the rule);
# per-step usage from /proc
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
ReturnToService=2
SchedulerType=sched/backfill
MpiDefault=none
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$CONF/slurmdbd.conf" <<EOF
# Written by clgpt's .ci/slurm.sh; \`.ci/slurm.sh stop\` removes it.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StorageUser=slurm
StoragePass=clgpt-ci
StorageLoc=clgpt_slurm_acct
EOF
  chmod 600 "$CONF/slurmdbd.conf"
}

start_munge() {
  if [ -f "$STATE/run/munged.pid" ] && kill -0 "$(cat "$STATE/run/munged.pid")" 2>/dev/null; then return; fi
  [ -s /etc/munge/munge.key ] || { mungekey --create --force; chown munge:munge /etc/munge/munge.key; }
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid
  for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid "$STATE/run/munged.pid"
}

start_mariadb() {
  if [ -f "$STATE/run/mariadb.started" ] && mysqladmin ping >/dev/null 2>&1; then return; fi
  /etc/init.d/mariadb start >/dev/null
  touch "$STATE/run/mariadb.started"
  mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'clgpt-ci';
            CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'clgpt-ci';
            CREATE DATABASE IF NOT EXISTS clgpt_slurm_acct;
            GRANT ALL ON clgpt_slurm_acct.* TO 'slurm'@'localhost';
            GRANT ALL ON clgpt_slurm_acct.* TO 'slurm'@'127.0.0.1';"
}

start_daemon() {  # NAME PIDFILE COMMAND...
  local name=$1 pidfile=$2
  shift 2
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then return; fi
  "$@"  # the slurm daemons fork into the background and write their pid file
  for _ in $(seq 100); do [ -s "$pidfile" ] && return; sleep 0.1; done
  log "$name did not start; its log:"; tail -20 "$STATE/log/$name.log" >&2; exit 1
}

wait_for() {  # SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq "$seconds"); do "$@" >/dev/null 2>&1 && return; sleep 1; done
  log "timed out waiting for $what"; tail -20 "$STATE"/log/*.log >&2; exit 1
}

start() {
  install_packages
  if cluster_up; then log "already running (node $NODE, partition $PARTITION)"; return; fi
  write_configs
  start_munge
  start_mariadb
  start_daemon slurmdbd "$STATE/run/slurmdbd.pid" slurmdbd
  wait_for 60 "slurmdbd" sacctmgr -n list cluster
  # the cluster, an account and root in it, so jobs are recorded under an association and sacct lists them
  sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
  sacctmgr -i -Q add account clgpt Cluster="$CLUSTER" Description=ci Organization=clgpt >/dev/null 2>&1 || true
  sacctmgr -i -Q add user root Account=clgpt Cluster="$CLUSTER" DefaultAccount=clgpt >/dev/null 2>&1 || true
  start_daemon slurmctld "$STATE/run/slurmctld.pid" slurmctld
  start_daemon slurmd "$STATE/run/slurmd.pid" slurmd -N "$NODE"
  wait_for 60 "node $NODE to be idle" cluster_up
  log "running: node $NODE ($(nproc) CPUs), partition $PARTITION, accounting through slurmdbd"
}

stop_pid() {  # PIDFILE: stop the process this script started and wait for it to go
  local pidfile=$1 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$pidfile"
}

stop() {
  # jobs first, so nothing the tests submitted outlives the cluster
  command -v scancel >/dev/null && timeout 10 scancel --full --quiet -u root >/dev/null 2>&1 || true
  stop_pid "$STATE/run/slurmd.pid"
  stop_pid "$STATE/run/slurmctld.pid"
  stop_pid "$STATE/run/slurmdbd.pid"
  if [ -f "$STATE/run/mariadb.started" ]; then
    mysql -e "DROP DATABASE IF EXISTS clgpt_slurm_acct; DROP USER IF EXISTS 'slurm'@'localhost';
              DROP USER IF EXISTS 'slurm'@'127.0.0.1';" 2>/dev/null || true
    /etc/init.d/mariadb stop >/dev/null 2>&1 || true
  fi
  stop_pid "$STATE/run/munged.pid"
  rm -f "$CONF/slurm.conf" "$CONF/slurmdbd.conf"
  rm -rf "$STATE"
  log "stopped and cleaned up"
}

status() {
  sinfo -N -l && sacct -X -a --format=JobID,JobName%30,State,Elapsed,AllocCPUS,ReqMem | tail -20
  cluster_up
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
