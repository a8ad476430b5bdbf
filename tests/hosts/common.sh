# Shared by the tests across simulated hosts: two hosts (moec-h0, moec-h1,
# 2 slots each) made by scripts/hosts.sh for the test and removed when it
# ends, however it ends. mpirun runs on moec-h0 and starts the ranks of
# moec-h1 through the rsh agent; OpenMPI's defaults, no MCA settings.
#   HOSTS_SH  scripts/hosts.sh (from the test's environment)
source "$(dirname "${BASH_SOURCE[0]}")/../mpi/common.sh"
export PATH="$PATH:/usr/sbin:/sbin"
HOSTS_SH="$(realpath "${HOSTS_SH:?set HOSTS_SH to scripts/hosts.sh}")"
if ! reason=$(bash "$HOSTS_SH" check 2>&1); then
  echo "FAILED: the tests across hosts cannot run here: $reason" >&2
  echo "(they need root, iproute2 and network namespaces; CI runs as root)" >&2
  exit 1
fi
HOSTS_DIR="$WORK/hosts"
trap 'bash "$HOSTS_SH" down --dir "$HOSTS_DIR"' EXIT
bash "$HOSTS_SH" up 2 --slots 2 --dir "$HOSTS_DIR"
source "$HOSTS_DIR/env"
# on HOST COMMAND...: runs COMMAND on a simulated host.
on() { bash "$HOSTS_SH" run "$@"; }
# mpirun on moec-h0 over both hosts: -np 4 puts ranks 0, 1 on moec-h0 and
# 2, 3 on moec-h1; add --map-by node for one rank per host.
MPIRUN=(bash "$HOSTS_SH" run moec-h0 mpirun --hostfile "$HOSTS_DIR/hostfile" --bind-to none)
