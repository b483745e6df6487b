# Shell functions shared by launch/slurm_rollout.sbatch, launch/slurm_train.sbatch and launch/rollout_node.sh.
# Sourced, never run. Every variable is documented in docs/cluster.md.

sapo_log() { echo "[$(date +%H:%M:%S)] $*"; }

sapo_die() {
  echo "[$(date +%H:%M:%S)] error: $*" >&2
  exit 1
}

# The IPv4 address this node's servers bind to and advertise (never 0.0.0.0): SAPO_BIND_ADDR if set, else the
# address of the interface SAPO_BIND_IFNAME (e.g. ib0, the cluster network), else what the node's hostname
# resolves to. A loopback answer only works while every job runs on one machine: warn, name the fix.
sapo_node_addr() {
  local addr
  if [ -n "${SAPO_BIND_ADDR:-}" ]; then
    addr=$SAPO_BIND_ADDR
  elif [ -n "${SAPO_BIND_IFNAME:-}" ]; then
    addr=$(ip -4 -o addr show dev "$SAPO_BIND_IFNAME" 2> /dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    [ -n "$addr" ] || sapo_die "SAPO_BIND_IFNAME=$SAPO_BIND_IFNAME: no IPv4 address on that interface here ($(hostname)); see: ip -br addr"
  else
    addr=$(getent ahostsv4 "$(hostname)" | awk 'NR == 1 {print $1}')
    [ -n "$addr" ] || sapo_die "$(hostname) does not resolve to an IPv4 address; set SAPO_BIND_IFNAME (e.g. ib0) or SAPO_BIND_ADDR"
    case $addr in
      127.*) echo "[$(date +%H:%M:%S)] warning: $(hostname) resolves to $addr (loopback): other nodes cannot reach it; set SAPO_BIND_IFNAME to the cluster interface" >&2 ;;
    esac
  fi
  echo "$addr"
}

# Poll URL (GET, no credentials: /health is open on SGLang, the router and the CPU server) until it answers
# 2xx. Returns 1 when process PID has exited meanwhile, 2 at the DEADLINE (seconds since the epoch).
sapo_wait_http() {
  local url=$1 pid=$2 deadline=$3
  until curl -sf -o /dev/null --max-time 5 "$url"; do
    kill -0 "$pid" 2> /dev/null || return 1
    [ "$(date +%s)" -lt "$deadline" ] || return 2
    sleep "${SAPO_POLL_S:-2}"
  done
}
