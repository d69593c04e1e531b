#!/usr/bin/env bash
# Test hosts as Linux network namespaces: N "hosts" NAME-h0..NAME-h{N-1}, each with its own
# eth0 (10.77.0.{i+1}/24) and loopback, all cabled by veth pairs to one bridge that lives in a
# third namespace NAME-sw (the switch). Nothing is created in, or routed to, the machine's own
# network namespace: traffic between hosts crosses the veth links and nothing else, and a
# link's bytes are that host's traffic to other hosts (read with `bytes`).
#
#   netns-hosts.sh check                 exit 0 if namespaces can be made here, else 77 + reason
#   netns-hosts.sh up NAME N             create (replacing leftovers of an earlier NAME)
#   netns-hosts.sh down NAME             delete everything named NAME-* (only that)
#   netns-hosts.sh exec NAME I CMD...    run CMD on host I (own UTS namespace: hostname NAME-hI)
#   netns-hosts.sh addr I                host I's address
#   netns-hosts.sh bytes NAME I          "<tx> <rx>" bytes host I sent/received on its link
#   netns-hosts.sh kill NAME I           SIGKILL every process on host I (a lost host)
#   netns-hosts.sh cut NAME I            take host I's switch port down: its packets vanish,
#                                        no reset reaches anyone (a pulled cable, a dead host)
#   netns-hosts.sh mend NAME I           bring host I's switch port back up
#   netns-hosts.sh mpi-agent             (OpenMPI plm_rsh_agent) HOST CMD...: run on HOST
#   netns-hosts.sh fixture-up NAME N FILE   ctest setup: `up`, or write why not into FILE
#
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2. See docs/launching.md.
set -euo pipefail

SUBNET=10.77.0
addr() { echo "$SUBNET.$(( $1 + 1 ))"; }

die() { echo "netns-hosts: $*" >&2; exit 1; }

check() {
  command -v ip >/dev/null || { echo "netns-hosts: iproute2 ('ip') is not installed" >&2; exit 77; }
  local probe="fsdpprobe$$"
  if ! ip netns add "$probe" 2>/tmp/netns-hosts-probe.$$; then
    echo "netns-hosts: cannot create network namespaces here ($(head -1 /tmp/netns-hosts-probe.$$)); multi-host tests need root with CAP_NET_ADMIN and CAP_SYS_ADMIN" >&2
    rm -f /tmp/netns-hosts-probe.$$
    exit 77
  fi
  local ok=1
  ip -n "$probe" link add name vA type veth peer name vB 2>/tmp/netns-hosts-probe.$$ || ok=0
  ip netns del "$probe"
  if [ $ok = 0 ]; then
    echo "netns-hosts: cannot create veth pairs ($(head -1 /tmp/netns-hosts-probe.$$))" >&2
    rm -f /tmp/netns-hosts-probe.$$
    exit 77
  fi
  rm -f /tmp/netns-hosts-probe.$$
}

down() {
  local name=$1
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || die "bad name '$name'"
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${name}-(sw|h[0-9]+)$" || true); do
    # Processes still inside a host (a test that failed) go with it.
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
  done
}

up() {
  local name=$1 n=$2
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le 8 ] || die "N must be 2..8, got '$n'"
  down "$name"
  trap 'down "$name"' ERR
  ip netns add "$name-sw"
  ip -n "$name-sw" link add br0 type bridge
  ip -n "$name-sw" link set br0 up
  for ((i = 0; i < n; i++)); do
    local h="$name-h$i"
    ip netns add "$h"
    # Both ends are created inside their namespaces: no interface ever appears outside.
    ip link add eth0 netns "$h" type veth peer name "h$i" netns "$name-sw"
    ip -n "$name-sw" link set "h$i" master br0 up
    ip -n "$h" addr add "$(addr "$i")/24" dev eth0
    ip -n "$h" link set eth0 up
    ip -n "$h" link set lo up
  done
  # Wait until every host reaches host 0 (bridge ports take a moment to forward).
  for ((i = 1; i < n; i++)); do
    local ok=0
    for _ in $(seq 50); do
      # Connected or "Connection refused" (nobody listens on port 9): the path works.
      local out
      out=$(ip netns exec "$name-h$i" timeout 2 bash -c "exec 3<>/dev/tcp/$(addr 0)/9 && echo open" 2>&1 || true)
      if [[ "$out" == *open* || "$out" == *refused* ]]; then ok=1; break; fi
      sleep 0.1
    done
    [ $ok = 1 ] || die "host $i cannot reach host 0 over the bridge"
  done
  trap - ERR
}

host_exec() {
  local name=$1 i=$2
  shift 2
  # Own UTS namespace too: each host has its own hostname (OpenMPI tells nodes apart by it).
  exec ip netns exec "$name-h$i" unshare --uts bash -c 'hostname "$0"; exec "$@"' "$name-h$i" "$@"
}

bytes() {
  local name=$1 i=$2
  # The host's eth0 counters: tx = what host i sent to others, rx = what it received.
  echo "$(ip netns exec "$name-h$i" cat /sys/class/net/eth0/statistics/tx_bytes)" \
       "$(ip netns exec "$name-h$i" cat /sys/class/net/eth0/statistics/rx_bytes)"
}

cmd=${1:-}
shift || true
case "$cmd" in
  check) check ;;
  up) [ $# = 2 ] || die "usage: up NAME N"; up "$@" ;;
  down) [ $# = 1 ] || die "usage: down NAME"; down "$1" ;;
  exec) [ $# -ge 3 ] || die "usage: exec NAME I CMD..."; host_exec "$@" ;;
  addr) [ $# = 1 ] || die "usage: addr I"; addr "$1" ;;
  bytes) [ $# = 2 ] || die "usage: bytes NAME I"; bytes "$@" ;;
  kill)
    [ $# = 2 ] || die "usage: kill NAME I"
    pids=$(ip netns pids "$1-h$2")
    [ -n "$pids" ] && kill -9 $pids
    echo "$pids" | wc -w ;;
  fixture-up)
    [ $# = 3 ] || die "usage: fixture-up NAME N FILE"
    rm -f "$3"
    if ! reason=$(check 2>&1); then echo "$reason" > "$3"; echo "$reason (tests will skip)"; exit 0; fi
    up "$1" "$2" ;;
  cut)
    [ $# = 2 ] || die "usage: cut NAME I"
    ip -n "$1-sw" link set "h$2" down ;;
  mend)
    [ $# = 2 ] || die "usage: mend NAME I"
    ip -n "$1-sw" link set "h$2" up ;;
  mpi-agent)
    # OpenMPI's rsh agent: "AGENT [options] HOST CMD...". HOST is NAME-hI.
    while [[ "${1:-}" == -* ]]; do shift; done
    host=$1; shift
    [[ "$host" =~ ^(.+)-h([0-9]+)$ ]] || die "mpi-agent: host '$host' is not NAME-hI"
    host_exec "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" bash -c "$*" ;;
  *) die "usage: netns-hosts.sh check|up|down|exec|addr|bytes|kill|cut|mend|mpi-agent ..." ;;
esac
