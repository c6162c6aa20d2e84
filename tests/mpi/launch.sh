#!/bin/sh
# launch.sh N PROGRAM [ARGS...]: starts N copies of PROGRAM as torch's launchers start the
# ranks of a data-parallel job, without mpiexec: RANK, LOCAL_RANK, WORLD_SIZE and
# LOCAL_WORLD_SIZE in the environment, and KFAC_STORE, a fresh FileStore path that the
# ranks rendezvous through. Exits with the first nonzero status of any rank (0 when all
# succeed); a rank's 77 (skipped) passes through. Killing the launcher kills the ranks.
set -u
n=$1
shift
dir=$(mktemp -d "${TMPDIR:-/tmp}/kfac_launch.XXXXXX")
pids=""
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null; done
  rm -rf "$dir"
}
trap 'cleanup; exit 143' TERM INT
rank=0
while [ "$rank" -lt "$n" ]; do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n KFAC_STORE="$dir/store" "$@" &
  pids="$pids $!"
  rank=$((rank + 1))
done
status=0
for p in $pids; do
  wait "$p"
  s=$?
  [ "$status" -eq 0 ] && status=$s
done
pids=""
cleanup
exit "$status"
