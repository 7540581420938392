#!/usr/bin/env bash
# The device calls for serving (issue 65) and long context (issue 66): one STEP a call, each within the 10-minute
# limit, on one H100 or H200; records are named by the card that ran them (wide.bench.timing.card_tag).
#   STEP=grid        bench.decode.long_context: B 1/4/16 x ctx 4k/16k/32k x fused dense / WIDE 0/50/70% / shipped
#                    rates, both split rules from 16k, TTFT at 4k/16k/32k      -> long-context-CARD.{json,md}
#                    (GRID_ARGS: more flags, e.g. '--batches 16 --contexts 16384,32768 --prompts= --rules short')
#   STEP=serve-long  wide bench serve, the long workload (engine rows)         -> serve-long-CARD.{json,md}
#   STEP=serve-chat  wide bench serve, the chat workload, the bare B 1 step, HF static-cache generate, batch
#                    dependence                                              -> serve-chat-CARD.{json,md}
#                    (SERVE_ARGS: more flags for either serve step, e.g. '--concurrency 4')
#   STEP=tests       the GPU suite (tests/kernels, tests/runtime, the engine's GPU tests), the long-context
#                    file alone first                                        -> gpu-tests-CARD.log
#   STEP=profile     bench.profile.profile_long_context: the fused step kernel by kernel at B 16 / 16k (B, CTX),
#                    dense, WIDE 50% and the shipped rates, and under each decode attention launch override set
#                    of SWEEP (default ATTN_SWEEP)                            -> profile-long-context-CARD.{json,md}
#                    then bench.kernels.sweep_prefill_attention: the routed prefill attention's launch
#                    configurations at 4k/16k/32k prompts vs SDPA             -> prefill-sweep-CARD.{json,md}
# BUDGET_S (default 420): no row starts after it; the step's own timeout is BUDGET_S + 150.
# Afterwards, here: python -m bench.decode.summarize_long_context bench/results/decode/long-context-CARD.json
#   --plot docs/plots/long-context-CARD.png (records go under bench/results/decode/ and bench/results/serve/).
set -u
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
CARD=$(python3 -c "from wide.bench.timing import card_tag; print(card_tag())")
BUDGET_S=${BUDGET_S:-420}
# the decode attention's launch override sets the profile step also times (SWEEP replaces them; docs/long-context.md)
ATTN_SWEEP="attn_programs=264;attn_programs=396;attn_programs=528;attn_warps=4;attn_block_n=64;attn_programs=528,attn_warps=4"
git log -1 --format='%h %s' > "$OUT/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/card.txt" 2>&1
case "${STEP:?set STEP=grid|serve-long|serve-chat|tests|profile}" in
  grid)
    timeout $((BUDGET_S + 150)) python3 -m bench.decode.long_context --out "$OUT" --budget-s "$BUDGET_S" \
      ${GRID_ARGS:-} > "$OUT/grid.log" 2>&1 ;;
  serve-long)
    timeout $((BUDGET_S + 150)) python3 -m wide.cli bench serve --out "$OUT" --workloads long --parts engine \
      --budget-s "$BUDGET_S" ${SERVE_ARGS:-} > "$OUT/serve-long.log" 2>&1 ;;
  serve-chat)
    timeout $((BUDGET_S + 150)) python3 -m wide.cli bench serve --out "$OUT" --workloads chat \
      --budget-s "$BUDGET_S" ${SERVE_ARGS:-} > "$OUT/serve-chat.log" 2>&1 ;;
  tests)
    # the GPU suite: tests/kernels and tests/runtime whole (on a GPU their kernel_device cases run on CUDA too) and
    # the engine's GPU tests; the long-context file alone first (its 16k-32k caches do not fit eight workers)
    N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
    # the shipped routers' CPU parity test needs the embedded SmolLM2 (setup.sh's GGUF parts); without it, left out
    D=""; python3 -c "from wide.model.loading import smollm2_gguf_path as p; p()" 2>/dev/null \
      || D="--deselect tests/runtime/test_runtime.py::test_shipped_routers_serve_what_was_evaluated"
    L="$OUT/gpu-tests-$CARD.log"
    WIDE_AUTOTUNE_MAX=1 timeout $((BUDGET_S / 3 + 50)) python3 -m pytest -q -p no:cacheprovider \
      tests/kernels/test_long_context.py > "$L" 2>&1
    echo "pytest exit $? (long context)" >> "$L"
    WIDE_AUTOTUNE_MAX=1 timeout $((2 * BUDGET_S / 3 + 50)) python3 -m pytest -q $N $D -p no:cacheprovider \
      --ignore=tests/kernels/test_long_context.py tests/kernels tests/runtime tests/serve/test_engine_gpu.py \
      >> "$L" 2>&1
    echo "pytest exit $?" >> "$L" ;;
  profile)
    timeout $((BUDGET_S / 2 + 60)) python3 -m bench.profile.profile_long_context --out "$OUT" --batch "${B:-16}" \
      --ctx "${CTX:-16384}" --attn-sweep "${SWEEP:-$ATTN_SWEEP}" > "$OUT/profile.log" 2>&1
    echo "profile exit $?" >> "$OUT/profile.log"
    timeout $((BUDGET_S / 2 + 60)) python3 -m bench.kernels.sweep_prefill_attention --out "$OUT" \
      --budget-s $((BUDGET_S / 2 - 30)) > "$OUT/prefill-sweep.log" 2>&1 ;;
  *) echo "unknown STEP=$STEP" >&2; exit 2 ;;
esac
echo "exit $?"
