#!/usr/bin/env bash
# A fresh machine's quality work from what a call carries in .device-carry/quality-work (seed_work.sh): the rows
# of work.tar.* (as packed by a run: an interrupted row's latest checkpoint too), the rows named in
# tree-rows.txt (their stage 1 from src/wide/checkpoints/) and the records file, each only where WORK lacks it
# (a warm machine keeps its own, which are newer). setup.sh runs it in every call that carries the folder, so it
# may ride in any call (e.g. beside data.tar.xz when evalwhl and the tree leave no room); quality.sh runs it too.
# Usage (repo root, GPU machine): WORK=$HOME/quality bash scripts/device/restore_work.sh
#   (CARRIED=DIR: read DIR instead of .device-carry/quality-work; tests)
set -u
WORK=${WORK:-$HOME/quality}
C=${CARRIED:-.device-carry/quality-work}
[ -d "$C" ] || exit 0
mkdir -p "$WORK"
# a fresh machine: the carried rows and records (a warm machine keeps its own, which are newer)
if compgen -G "$C/work.tar.*" >/dev/null; then
  x=$(mktemp -d)
  cat "$C"/work.tar.* | tar -xf - -C "$x"
  for d in "$x"/*; do
    [ -e "$d" ] || continue
    n=$(basename "$d")
    [ -e "$WORK/$n" ] || { mv "$d" "$WORK/" && echo "$n: restored from $C"; }
  done
  rm -rf "$x"
fi
# rows seeded from the shipped checkpoints in the tree (seed_work.sh): their stage 1 as shipped
while read -r n ck; do
  [ -e "$WORK/$n" ] && continue
  mkdir -p "$WORK/$n/stage1"
  cp "src/wide/checkpoints/$ck"/{routers.safetensors,wide_config.json,train_log.jsonl} "$WORK/$n/stage1/" &&
    echo "$n: restored from src/wide/checkpoints/$ck"
done < <(cat "$C/tree-rows.txt" 2>/dev/null)
[ -f "$WORK/quality.json" ] || [ ! -f "$C/quality.json" ] || cp "$C/quality.json" "$WORK/"
