#!/usr/bin/env bash
# Device call 2 (and more if needed) of the SmolLM2-135M router calibrations (calibrate_start.sh):
# waits for the runs still going here; resumes (detached, mode of its last launch) a run that is
# neither finished nor running: a fresh machine (carry its tar as .device-carry/calib_sNN.tar, see
# calibrate_lib.sh) or a killed run. After DEADLINE_S (default 420) s with a run unfinished:
# checkpoints into $OUT as the start script does, exit 3 (call again). Once both finished: WikiText-2
# perplexity (full set, 2,048-token windows) dense vs both routers, and into $OUT calib_final.tar
# (final routers, training logs, eval, summary), calib_summary.md, wide_ppl.{json,md}.
# Usage (repo root; carry .device-carry/evalwhl for the lm-eval cross-check):
#   bash scripts/device/calibrate_finish.sh OUT [STEPS]
# Env: as the start script, plus EVAL_LIMIT (WikiText-2 documents), EVAL_BATCH, EVAL_MAXLEN, WIDE_EVAL_EXTRA.
# Exit: 0 done, 3 deadline (runs unfinished), 4 model or data missing, 5 a run stopped unfinished, 6 eval failed.
set -u
T0=$(date +%s)
OUT=${1:-/tmp/out}
STEPS=${2:-${STEPS:-2000}}
source scripts/device/calibrate_lib.sh
DEADLINE_S=${DEADLINE_S:-420}

for s in $SPARSITIES; do restore "$s"; done
need=0
for s in $SPARSITIES; do finished "$s" || alive "$s" || need=1; done
if [ "$need" = 1 ] && ! inputs_ready; then rc=4; else
  start_missing
  monitor "$DEADLINE_S"
fi
echo "after $(elapsed) s:"
report | tee "$OUT/progress.txt"
for s in $SPARSITIES; do
  finished "$s" && continue
  alive "$s" && rc=${rc:-3} || rc=${rc:-5}
done
if [ -n "${rc:-}" ]; then # not done: what resumes them, as the start script leaves it
  for s in $SPARSITIES; do
    snapshot "$s"
    cp "$R/calibrate_s$s.log" "$OUT/" 2>/dev/null
  done
  tail_logs
  ls -la "$OUT"
  exit "$rc"
fi

# Both finished: perplexity dense vs routed (lm-eval's own wikitext as a cross-check if it is installed).
chk=""
python3 -c "import lm_eval" 2>/dev/null || chk=--no-lm-eval-check
case "$chk ${WIDE_EVAL_EXTRA:-}" in *--no-lm-eval-check*) check="no lm-eval cross-check" ;; *) check="lm-eval cross-check" ;; esac
t=$(date +%s)
routers=""
for s in $SPARSITIES; do routers="$routers $R/s$s"; done
# shellcheck disable=SC2086
python3 -m wide.cli eval --model smollm2-135m --routers $routers --tasks wikitext \
  --max-length "${EVAL_MAXLEN:-2048}" --batch-size "${EVAL_BATCH:-16}" --out "$R/wide_ppl" \
  ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"} $chk ${WIDE_EVAL_EXTRA:-} >"$R/wide_ppl.log" 2>&1 || rc=6
eval_s=$(($(date +%s) - t))

S=$R/calib_summary.md
{
  echo "# SmolLM2-135M router calibration ($STEPS steps x $BATCH x $SEQ tokens)"
  echo
  echo "Per run (from train_log.jsonl and the final wide_config.json; wall time counts training steps"
  echo "only, restored across resumes; launches lists compile|eager per launch):"
  echo
  report | sed 's/^/- /'
  for s in $SPARSITIES; do
    m=$(cut -d' ' -f3 "$R/s$s/launches.txt" | sort -u | tr '\n' ' ')
    case "$m" in "compile ") c=yes ;; "eager ") c=no ;; *) c="partly (launches: $m)" ;; esac
    echo "- s$s --compile: $c"
    [ -f "$R/s$s/compile_fallback.txt" ] && sed "s/^/- s$s: /" "$R/s$s/compile_fallback.txt"
  done
  echo
  echo "WikiText-2 (wide eval, ${EVAL_LIMIT:+first $EVAL_LIMIT documents, }max length ${EVAL_MAXLEN:-2048}, $check): $eval_s s"
  echo
  cat "$R/wide_ppl.md" 2>/dev/null || tail -n 20 "$R/wide_ppl.log"
} >"$S"
cat "$S"

st=$(mktemp -d)
for s in $SPARSITIES; do
  mkdir -p "$st/runs/s$s"
  cp "$R/s$s"/{wide_config.json,routers.safetensors,train_log.jsonl,launches.txt} "$st/runs/s$s/"
  cp "$R/s$s/compile_fallback.txt" "$st/runs/s$s/" 2>/dev/null
  cp "$R/calibrate_s$s.log" "$st/runs/"
done
cp "$S" "$R"/wide_ppl.{json,md,log} "$st/runs/" 2>/dev/null
tar -cf "$OUT/calib_final.tar" -C "$st" runs
rm -rf "$st"
cp "$S" "$R"/wide_ppl.{json,md} "$OUT/" 2>/dev/null
tail_logs
ls -la "$OUT"
exit "${rc:-0}"
