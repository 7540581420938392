#!/usr/bin/env bash
# The quality sweep (scripts/device/quality.sh) as a detached run that outlives one device call, for rows
# longer than a call (the 1,000-step LoRA rows) or started before every input is on the machine: a warm
# machine runs it on between calls, and a call that ends while it runs keeps the machine ~30 s only, so the
# next call must follow at once (a machine given back ends the run; its checkpoints are on that machine).
#   start            copy the working tree to $BG/repo and run quality.sh there in its own session (setsid),
#                    writing to $BG/out; returns at once. Env as quality.sh (SPEC, JOBS, BUDGET_S, ...);
#                    BUDGET_S counts from the start, so it may exceed one call.
#   collect [WAIT_S] wait up to WAIT_S s (0) for the run to end, then copy what it has written into $OUT:
#                    quality.json, quality-driver.log, quality-gpu.csv, gpu-tests-CARD.log (with TEST_S),
#                    quality-tails.txt (now, from the rows' logs), and quality-work/ once the run has ended
#                    (its packed parts).
#   fetch NAME[,NAME] [WAIT_S]  waits up to WAIT_S s (0) for the run to end, then packs those rows' files
#                    (routers, configs, a LoRA adapter) alone into $OUT/quality-work/work.tar.NN (PACK_PARTS, 4),
#                    for what did not fit the run's own parts. Issue it in the same message as `start` and the
#                    `collect` calls: a machine idle for ~30 s between messages is given back, rows and all.
# Inputs that arrive in a later call (e.g. evalwhl, needed only when a row reaches its evaluation) are
# installed by that call's `source scripts/device/setup.sh` before `collect`; the run picks them up.
# Usage (repo root, on the GPU machine): bash scripts/device/quality_bg.sh start|collect [WAIT_S]|fetch NAMES [WAIT_S]
set -u
BG=${BG:-$HOME/quality-bg}
running() { [ -f "$BG/pid" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; }
case "${1:-}" in
  start)
    if running; then echo "already running (pid $(cat "$BG/pid"))"; exit 0; fi
    rm -rf "$BG/repo" "$BG/out" && mkdir -p "$BG/repo" "$BG/out"
    # the call's own tree is replaced by the next call's: the run reads a copy (without the GGUF parts)
    tar --exclude=./.git --exclude='./.device-carry/smol.part.*' -cf - . | tar -xf - -C "$BG/repo"
    rm -f "$BG/pid"
    # the run writes its own pid: setsid forks when its caller leads a process group, so `$!` would
    # name a process that has already exited (a run that looks ended while it trains)
    cd "$BG/repo" && setsid nohup bash -c 'echo $$ >"$1/pid"; exec bash scripts/device/quality.sh "$1/out"' \
      _ "$BG" >"$BG/call.log" 2>&1 </dev/null &
    sleep 5
    running && echo "started (pid $(cat "$BG/pid")), writing $BG/out" || { tail -20 "$BG/call.log"; exit 1; }
    ;;
  collect)
    : "${OUT:?set OUT to the output folder of this call}"
    end=$(($(date +%s) + ${2:-0}))
    while running && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    for f in quality.json quality-driver.log quality-gpu.csv "$BG"/out/gpu-tests-*.log; do
      f=$(basename "$f")
      [ -f "$BG/out/$f" ] && cp "$BG/out/$f" "$OUT/"
    done
    bash scripts/device/row_tails.sh "${WORK:-$HOME/quality}" >"$OUT/quality-tails.txt"
    if running; then
      echo "still running (pid $(cat "$BG/pid")); $(grep -c '^\[done\]' "$BG/out/quality-driver.log" 2>/dev/null) rows done"
    else
      [ -d "$BG/out/quality-work" ] && cp -r "$BG/out/quality-work" "$OUT/"
      tail -5 "$BG/call.log"
      echo "ended"
    fi
    ;;
  fetch)
    : "${OUT:?set OUT to the output folder of this call}" "${2:?name the rows: fetch NAME[,NAME] [WAIT_S]}"
    end=$(($(date +%s) + ${3:-0}))
    while running && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    if running; then echo "still running (pid $(cat "$BG/pid")): fetch again later" >&2; exit 1; fi
    python3 -m bench.quality.pack_work "${WORK:-$HOME/quality}" "$OUT/quality-work" "${PACK_PARTS:-4}" --rows "$2"
    ls -la "$OUT/quality-work"
    ;;
  *)
    echo "usage: bash scripts/device/quality_bg.sh start|collect [WAIT_S]|fetch NAME[,NAME] [WAIT_S]" >&2
    exit 2
    ;;
esac
