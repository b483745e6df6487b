#!/bin/bash
# A throw-away Slurm cluster on this machine for the launch tests and CI: munged, slurmctld and two slurmd's
# that emulate two GPU-less nodes (sapo1, sapo2) on loopback, in one partition "ci".
#
#   tests/launch/slurm_cluster.sh up       # idempotent: a second call sees it running and returns at once
#   tests/launch/slurm_cluster.sh status   # exit 0 when both nodes answer (idle / mixed / allocated)
#   tests/launch/slurm_cluster.sh down     # stops the daemons this script started (by their pid files)
#
# Needs root and Debian's slurm-wlm + munge (.ci/run installs them). Two nodes because the launch scripts ask
# for whole nodes (--exclusive): the rollout job holds one, the train job the other, as on a real cluster.
# Refuses to touch a /etc/slurm/slurm.conf that it did not write (a real cluster's login node).
set -euo pipefail

MARKER="# written by sapo_megatron tests/launch/slurm_cluster.sh"
CONF=/etc/slurm/slurm.conf
NODES=(sapo1 sapo2)
NODE_PORTS=(17011 17012)
CTLD_PORT=17010
STATE=/var/spool/sapo-slurm
LOGS=/var/log/sapo-slurm
RUN=/run/sapo-slurm

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

cluster_answers() {
  # Both nodes registered and usable; "idle*" / "down" / "drained" do not count.
  local states
  states=$(sinfo -h -N -o '%N %T' 2> /dev/null | sort -u) || return 1
  for node in "${NODES[@]}"; do
    grep -Eq "^$node (idle|mixed|allocated|completing)$" <<< "$states" || return 1
  done
}

ensure_munge() {
  if munge -n 2> /dev/null | unmunge > /dev/null 2>&1; then return; fi
  [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n | unmunge > /dev/null 2>&1 && return; sleep 0.1; done
  die "munged did not start (see /var/log/munge/munged.log)"
}

write_conf() {
  if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script: not touching a real cluster's configuration"
  fi
  local host cpus
  host=$(hostname -s)
  cpus=$(nproc)
  install -d -m 0755 "$STATE" "$LOGS" "$RUN" /etc/slurm
  for dir in ctld "${NODES[@]}"; do install -d -m 0755 "$STATE/$dir"; done
  cat > "$CONF.tmp" << EOF
$MARKER
ClusterName=sapo-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
MpiDefault=none
MinJobAge=600
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$(IFS=,; echo "${NODES[*]}") NodeHostname=$host NodeAddr=127.0.0.1 Port=$(IFS=,; echo "${NODE_PORTS[*]}") CPUs=$cpus State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null; }

start_daemons() {
  # A controller that is not running means the cluster went away with the machine (or a container restart):
  # start from a clean state. slurmctld would otherwise recover the jobs that were running then as RUNNING and
  # hold the nodes for them until it notices, minutes later, that their batch steps are gone.
  if ! pid_alive "$RUN/slurmctld.pid"; then
    for node in "${NODES[@]}"; do
      if pid_alive "$RUN/slurmd-$node.pid"; then
        kill "$(cat "$RUN/slurmd-$node.pid")"
        for _ in $(seq 50); do pid_alive "$RUN/slurmd-$node.pid" || break; sleep 0.1; done
      fi
      find "$STATE/$node" -mindepth 1 -delete
    done
    slurmctld -c
  fi
  for node in "${NODES[@]}"; do
    pid_alive "$RUN/slurmd-$node.pid" || slurmd -c -N "$node"
  done
}

up() {
  [ "$(id -u)" = 0 ] || die "needs root (it starts munged, slurmctld and slurmd)"
  command -v slurmctld > /dev/null || die "slurmctld not found: apt-get install slurm-wlm munge"
  # (sinfo retries for about 10 s when slurmctld is down: look at its pid file first)
  if [ -e "$CONF" ] && grep -qF "$MARKER" "$CONF" && pid_alive "$RUN/slurmctld.pid" && cluster_answers; then
    echo "slurm cluster already up: ${NODES[*]}"
    return
  fi
  ensure_munge
  write_conf
  start_daemons
  for _ in $(seq 300); do
    if cluster_answers; then
      echo "slurm cluster up: ${NODES[*]} (partition ci)"
      return
    fi
    sleep 0.1
  done
  sinfo -N >&2 || true
  tail -n 20 "$LOGS"/*.log >&2 || true
  die "nodes did not become idle within 30 s"
}

down() {
  for pidfile in "$RUN"/slurmd-*.pid "$RUN/slurmctld.pid"; do
    if pid_alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
  done
}

case "${1:-up}" in
  up) up ;;
  status) pid_alive "$RUN/slurmctld.pid" && cluster_answers ;;
  down) down ;;
  *) die "usage: $0 [up|status|down]" ;;
esac
