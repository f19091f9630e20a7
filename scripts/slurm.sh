#!/usr/bin/env bash
# A real Slurm on this machine for the test suite: munge, one slurmctld and two slurmd nodes
# (n1, n2: Slurm's multiple-slurmd mode, one daemon per node name on its own port, all on
# 127.0.0.1), configured in a directory of their own. CPU nodes: no GPU gres (the bridge then
# asks for --ntasks-per-node instead of --gpus-per-node), no cgroup enforcement.
#
#   scripts/slurm.sh install   apt-get install slurm-wlm and munge when sbatch or munged is missing
#   scripts/slurm.sh start     write the configuration, start munged, slurmctld and the slurmd nodes
#                              unless they answer already; wait until both nodes are idle
#   scripts/slurm.sh stop      stop the daemons this script started (their pid files), and munged
#   scripts/slurm.sh status    exit 0 when the partition answers with its nodes up
#
# Clients find the configuration through SLURM_CONF=$FTQ_SLURM_DIR/etc/slurm.conf (the fixture,
# tests/fixtures/slurm.py, sets it); FTQ_SLURM_DIR defaults to /var/lib/ftq-slurm.
set -euo pipefail

DIR=${FTQ_SLURM_DIR:-/var/lib/ftq-slurm}
ETC=$DIR/etc
export SLURM_CONF=$ETC/slurm.conf
NODES=(n1 n2)
CPUS=${FTQ_SLURM_CPUS:-4}
PARTITION=${FTQ_SLURM_PARTITION:-ftq}
CTLD_PORT=${FTQ_SLURM_PORT:-16817}

install() {
  if command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  echo "slurm.sh: installing slurm-wlm and munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
}

write_config() {
  mkdir -p "$ETC" "$DIR/state" "$DIR/log" "$DIR/run"
  for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
  local user; user=$(id -un)
  cat >"$ETC/slurm.conf" <<CONF
# Written by scripts/slurm.sh: a test cluster on 127.0.0.1 (two nodes, multiple-slurmd style).
ClusterName=ftq-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=16818
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=20
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=20
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=16821 CPUs=$CPUS RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=16822 CPUs=$CPUS RealMemory=2000 State=UNKNOWN
PartitionName=$PARTITION Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  cat >"$ETC/cgroup.conf" <<CONF
CgroupPlugin=autodetect
IgnoreSystemd=yes
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
CONF
}

up() {
  sinfo -h -p "$PARTITION" -o '%D %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/ {n += $1} END {exit !(n >= 2)}'
}

start() {
  install
  if up; then echo "slurm.sh: Slurm is up (partition $PARTITION)"; return 0; fi
  write_config
  if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null || \
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged --force 2>/dev/null || munged --force
    touch "$DIR/run/munged.ours"
  fi
  pidalive "$DIR/run/slurmctld.pid" || slurmctld -i
  for node in "${NODES[@]}"; do
    pidalive "$DIR/run/slurmd-$node.pid" || slurmd -N "$node"
  done
  for _ in $(seq 1 120); do
    if up; then echo "slurm.sh: Slurm is up (partition $PARTITION: ${NODES[*]})"; return 0; fi
    sleep 0.5
  done
  echo "slurm.sh: the Slurm nodes did not come up within 60 s; see $DIR/log/" >&2
  sinfo -N >&2 || true
  return 1
}

pidalive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {
  for node in "${NODES[@]}"; do stop_pid "$DIR/run/slurmd-$node.pid"; done
  stop_pid "$DIR/run/slurmctld.pid"
  if [ -e "$DIR/run/munged.ours" ]; then
    stop_pid /run/munge/munged.pid
    rm -f "$DIR/run/munged.ours"
  fi
}

stop_pid() {  # stop_pid FILE: SIGTERM the process it names, wait up to 10 s
  pidalive "$1" || return 0
  local pid; pid=$(cat "$1")
  kill "$pid"
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) up ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
