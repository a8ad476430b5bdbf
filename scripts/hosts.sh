#!/usr/bin/env bash
# Simulated hosts on one Linux machine, for runs across machines without a
# second machine: each host is a network namespace with a hostname of its
# own (unshare --uts), joined to the others by veth pairs through a bridge
# that lives in a namespace of its own. Nothing is addressed outside the
# namespaces made here; the hosts' network is 10.213.47.0/24.
#
#   hosts.sh up N [--slots S] [--dir DIR]
#       makes hosts moec-h0 .. moec-h(N-1) (S slots each, default 2) and
#       writes DIR (default /tmp/moec-hosts):
#         DIR/hostfile   for mpirun --hostfile
#         DIR/bin/ssh    the rsh agent: "ssh HOST COMMAND" runs COMMAND on
#                        HOST; put DIR/bin first on PATH and mpirun (whose
#                        default agent is ssh) starts its daemons with it
#         DIR/env        "source DIR/env" does both, plus root permission
#       Leftovers of an earlier bed are removed first.
#   hosts.sh down [--dir DIR]
#       kills every process in the hosts, removes the namespaces, the links
#       and DIR. Safe to call twice, and when nothing is up.
#   hosts.sh run HOST COMMAND...
#       runs COMMAND on HOST (its namespace and hostname), e.g. mpirun on
#       moec-h0, or `ip link set eth0 down` to cut its link.
#   hosts.sh check
#       exits 0 when namespaces can be made here, else says why and exits 1.
#
# Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2 and util-linux.
set -euo pipefail

PREFIX=moec-h
SWITCH=moec-sw
NET=10.213.47
DIR=/tmp/moec-hosts

die() {
  echo "hosts.sh: $*" >&2
  exit 1
}

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

# why: prints why namespaces cannot be made here (nothing when they can).
why() {
  [ "$(id -u)" -eq 0 ] || { echo "not root (uid $(id -u)): network namespaces need root"; return; }
  command -v ip > /dev/null || { echo "no 'ip' command (Debian package iproute2)"; return; }
  command -v unshare > /dev/null || { echo "no 'unshare' command (Debian package util-linux)"; return; }
  local probe="moec-probe-$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "ip netns add failed: $err"
    return
  fi
  if ! err=$(ip netns exec "$probe" unshare --uts -- hostname "$probe" 2>&1); then
    ip netns del "$probe" 2> /dev/null || true
    echo "unshare --uts in a namespace failed: $err"
    return
  fi
  if ! err=$(ip -n "$probe" link add probe0 type veth peer name probe1 2>&1); then
    ip netns del "$probe" 2> /dev/null || true
    echo "ip link add ... type veth failed: $err"
    return
  fi
  ip netns del "$probe"
}

# reach HOST ADDRESS: a TCP connection from host 0 to a listener on HOST.
reach() {
  ip netns exec "$1" timeout 10 python3 -c '
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 40999)); s.listen(1); s.settimeout(8); s.accept()
' "$2" &
  local listener=$! tries
  for tries in 1 2 3 4 5 6 7 8 9 10; do
    if ip netns exec "${PREFIX}0" timeout 2 python3 -c '
import socket, sys
socket.create_connection((sys.argv[1], 40999), timeout=1)
' "$2" 2> /dev/null; then
      wait "$listener" 2> /dev/null || true
      return 0
    fi
    sleep 0.3
  done
  kill "$listener" 2> /dev/null || true
  return 1
}

# The namespaces of an earlier bed, whatever its size.
ours() {
  ip netns list 2> /dev/null | awk '{print $1}' | grep -E "^(${PREFIX}[0-9]+|${SWITCH})$" || true
}

down() {
  local ns
  for ns in $(ours); do
    # Processes left in a host (a daemon of a killed job) would keep its
    # network alive: end them first.
    ip netns pids "$ns" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
  done
  for ns in $(ours); do
    ip netns del "$ns" 2> /dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  [ -f "$DIR/hostfile" ] && rm -rf "$DIR"
  return 0
}

up() {
  local n=$1 slots=$2 i host
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] ||
    die "up: the number of hosts must be 1 to 200, not '$n'"
  [[ "$slots" =~ ^[0-9]+$ ]] && [ "$slots" -ge 1 ] || die "up: --slots must be a positive number"
  local reason
  reason=$(why)
  [ -z "$reason" ] || die "cannot make simulated hosts here: $reason"
  down
  trap 'down; exit 1' ERR INT TERM
  mkdir -p "$DIR/bin"
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  ip -n "$SWITCH" link set lo up
  local hosts="127.0.0.1 localhost"$'\n'
  for ((i = 0; i < n; i++)); do
    hosts+="$NET.$((10 + i)) $PREFIX$i"$'\n'
  done
  : > "$DIR/hostfile"
  for ((i = 0; i < n; i++)); do
    host="$PREFIX$i"
    ip netns add "$host"
    # Name resolution inside the host: ip netns exec binds
    # /etc/netns/NAME/hosts over /etc/hosts.
    mkdir -p "/etc/netns/$host"
    printf '%s' "$hosts" > "/etc/netns/$host/hosts"
    echo "$host" > "/etc/netns/$host/hostname"
    ip -n "$SWITCH" link add "p$i" type veth peer name eth0 netns "$host"
    ip -n "$SWITCH" link set "p$i" master br0
    ip -n "$SWITCH" link set "p$i" up
    ip -n "$host" addr add "$NET.$((10 + i))/24" dev eth0
    ip -n "$host" link set eth0 up
    ip -n "$host" link set lo up
    echo "$host slots=$slots" >> "$DIR/hostfile"
  done
  # The rsh agent: mpirun calls "ssh [options] HOST COMMAND"; like ssh, the
  # command runs on HOST in a fresh login-like environment.
  cat > "$DIR/bin/ssh" << EOF
#!/bin/sh
# ssh [options] HOST COMMAND...: runs COMMAND on simulated host HOST.
while [ \$# -gt 0 ]; do
  case "\$1" in
    -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=\$1
shift
case "\$host" in ${PREFIX}[0-9]*) ;; *) echo "ssh: \$host is not a simulated host" >&2; exit 255 ;; esac
exec ip netns exec "\$host" unshare --uts -- env -i PATH="$PATH" HOME="\${HOME:-/root}" \\
  /bin/sh -c 'hostname "\$0" && exec /bin/sh -c "\$1"' "\$host" "\$*"
EOF
  chmod +x "$DIR/bin/ssh"
  cat > "$DIR/env" << EOF
# source this file: mpirun then starts its daemons on the simulated hosts.
export PATH="$DIR/bin:\$PATH"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MOEC_HOSTFILE="$DIR/hostfile"
EOF
  # Every host reaches every other one.
  for ((i = 1; i < n; i++)); do
    reach "$PREFIX$i" "$NET.$((10 + i))" || { down; die "up: ${PREFIX}0 cannot reach $PREFIX$i"; }
  done
  trap - ERR INT TERM
  echo "hosts: $n up (${PREFIX}0 .. $PREFIX$((n - 1)), $slots slots each); hostfile $DIR/hostfile"
}

run() {
  local host=$1
  shift
  ip netns list | awk '{print $1}' | grep -qx "$host" || die "run: no simulated host '$host' (hosts.sh up N first)"
  exec ip netns exec "$host" unshare --uts -- /bin/sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
# run passes its command on untouched.
if [ "$cmd" = run ]; then
  [ $# -ge 2 ] || die "usage: hosts.sh run HOST COMMAND..."
  run "$@"
fi
slots=2
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --slots) slots=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$cmd" in
  up) [ ${#args[@]} -eq 1 ] || die "usage: hosts.sh up N [--slots S] [--dir DIR]"; up "${args[0]}" "$slots" ;;
  down) down ;;
  check) reason=$(why); [ -z "$reason" ] || die "cannot make simulated hosts here: $reason" ;;
  -h | --help | help) usage ;;
  *) usage >&2; exit 2 ;;
esac
