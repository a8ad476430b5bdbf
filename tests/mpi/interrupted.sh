#!/usr/bin/env bash
# A run killed while it writes its outputs folder over an earlier run's
# (SIGKILL, SIGTERM, SIGINT in process; SIGKILL of rank 0 under mpirun):
# the folder still holds the earlier run whole (its manifest checks, and
# --inputs reads it), the new folder the killed run left beside it is
# removed by the next run, and that run's folder replaces the old one
# whole. A folder without a manifest, or with a file whose size or CRC
# the manifest does not give, is refused as --inputs unless --hand-made.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

passed=0
failed=0

# Big enough that writing takes a while (w1 is 128 MiB).
layer big 2048 1024 4 2 2 fp32
S=(--threads 1 --timeout 30 --no-progress)
out="$WORK/out"
"$MOEC" run "$WORK/big/fwd.moebin" --random 1 --ranks 2 --outputs "$out" "${S[@]}" > /dev/null
first=$(sha256sum "$out/manifest.json" | cut -d' ' -f1)

# intact LABEL: the folder is the first run's, whole.
intact() {
  if [ "$(sha256sum "$out/manifest.json" | cut -d' ' -f1)" != "$first" ]; then
    bad "$1: the manifest is not the first run's"
  elif ! "$MOEC" run "$WORK/big/fwd.moebin" --ranks 2 --inputs "$out" --outputs "$WORK/replay" \
      "${S[@]}" > "$WORK/replay.log" 2>&1; then
    bad "$1: the folder no longer reads as the first run's" "$WORK/replay.log"
  else
    ok "$1"
  fi
}

# kill_while_writing LABEL SIGNAL COMMAND...: starts COMMAND (a run with
# --random 2 into $out), waits for its new folder to hold a file, sends
# SIGNAL to the moec process that writes it.
kill_while_writing() {
  local label=$1 signal=$2 pid= folder
  shift 2
  # New folders that dead runs left: not this run's.
  local before
  before=$(compgen -G "$WORK/.out.moec-new.*" || true)
  "$@" > "$WORK/$label.log" 2>&1 &
  local job=$!
  for _ in $(seq 1 3000); do
    for folder in $(compgen -G "$WORK/.out.moec-new.*" || true); do
      if ! grep -qxF "$folder" <<< "$before" && compgen -G "$folder/x.npy*" > /dev/null; then
        pid=${folder##*moec-new.}
        break 2
      fi
    done
    sleep 0.01
  done
  if [ -z "$pid" ]; then
    bad "$label: the run never wrote into a new folder" "$WORK/$label.log"
    wait "$job" || true
    return
  fi
  kill "-$signal" "$pid" 2> /dev/null || true
  wait "$job" || true
  intact "$label: the folder is the earlier run's"
}

kill_while_writing sigkill KILL "$MOEC" run "$WORK/big/fwd.moebin" --random 2 --ranks 2 \
  --outputs "$out" "${S[@]}"
if compgen -G "$WORK/.out.moec-new.*" > /dev/null; then
  ok "sigkill: the killed run's new folder is left (no handler runs)"
else
  bad "sigkill: no new folder was left, so the cleaning below is not tested"
fi
kill_while_writing sigterm TERM "$MOEC" run "$WORK/big/fwd.moebin" --random 2 --ranks 2 \
  --outputs "$out" "${S[@]}"
kill_while_writing sigint INT "$MOEC" run "$WORK/big/fwd.moebin" --random 2 --ranks 2 \
  --outputs "$out" "${S[@]}"
kill_while_writing mpi-rank-0 KILL "${MPIRUN[@]}" -np 2 "$MOEC" run "$WORK/big/fwd.moebin" \
  --random 2 --outputs "$out" "${S[@]}"

# The next run cleans what the dead ones left and replaces the folder.
"$MOEC" run "$WORK/big/fwd.moebin" --random 3 --ranks 2 --outputs "$out" "${S[@]}" > /dev/null
if compgen -G "$WORK/.out.moec-new.*" > /dev/null || compgen -G "$out/*.tmp.*" > /dev/null; then
  bad "clean: new folders or temporaries of dead runs are left: $(ls -a "$WORK" "$out")"
elif [ "$(sha256sum "$out/manifest.json" | cut -d' ' -f1)" = "$first" ]; then
  bad "clean: the folder is still the first run's"
else
  ok "clean: the next run removed the dead runs' folders and replaced the folder"
fi

# refused NAME PATTERN COMMAND...: exits 1 with a line matching PATTERN.
refused() {
  local name=$1 pattern=$2
  shift 2
  if "$@" > "$WORK/$name.log" 2>&1; then
    bad "$name: exited 0" "$WORK/$name.log"
  elif ! grep -qE "$pattern" "$WORK/$name.log"; then
    bad "$name: no line matches '$pattern'" "$WORK/$name.log"
  else
    ok "$name"
  fi
}
cp -r "$out" "$WORK/cut" && truncate -s -4 "$WORK/cut/x.npy"
refused cut-short "cut/x.npy: holds [0-9]+ bytes; manifest.json says [0-9]+: the file was cut short" \
  "$MOEC" run "$WORK/big/fwd.moebin" --ranks 2 --inputs "$WORK/cut" --outputs "$WORK/o" "${S[@]}"
cp -r "$out" "$WORK/bare" && rm "$WORK/bare/manifest.json"
refused no-manifest "bare: has no manifest.json.*say so with --hand-made" \
  "$MOEC" run "$WORK/big/fwd.moebin" --ranks 2 --inputs "$WORK/bare" --outputs "$WORK/o" "${S[@]}"
if "$MOEC" run "$WORK/big/fwd.moebin" --ranks 2 --inputs "$WORK/bare" --hand-made \
    --outputs "$WORK/o" "${S[@]}" > "$WORK/hand-made.log" 2>&1; then
  ok "hand-made: a folder without a manifest reads with --hand-made"
else
  bad "hand-made: refused" "$WORK/hand-made.log"
fi
mkdir -p "$WORK/mine" && echo notes > "$WORK/mine/notes.txt"
refused foreign-file "mine: holds 'notes.txt', which no run writes" \
  "$MOEC" run "$WORK/big/fwd.moebin" --ranks 2 --random 1 --outputs "$WORK/mine" "${S[@]}"
[ -f "$WORK/mine/notes.txt" ] && ok "foreign-file: the user's file is untouched" ||
  bad "foreign-file: the user's file is gone"

echo "interrupted runs: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
