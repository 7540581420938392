#!/usr/bin/env bash
# Dense SmolLM2-135M on the seven zero-shot tasks + WikiText-2 (full sets), the paper's protocol.
# Usage (repo root): scripts/device/eval_dense.sh OUTDIR
# Needs: .device-carry/evalwhl/*.whl (lm-eval 0.4.13 and the pure-python deps the GPU image lacks),
#        the GGUF at $WIDE_SMOLLM2_GGUF (default ~/.cache/wide/SmolLM2-135M-Instruct.Q4_1.gguf),
#        the data at $WIDE_DATA (default shared/data in the repo root).
# Overrides (env): DEVICE=cuda DTYPE=bfloat16 BATCH_SIZE=64 MAX_LENGTH=4096 LIMIT= TASKS=all
#                  PYTHON=python3 EVAL_SITE=/tmp/evalsite (SKIP_WHEELS=1: use what is installed)
set -euo pipefail
out=${1:?usage: scripts/device/eval_dense.sh OUTDIR}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
site=${EVAL_SITE:-/tmp/evalsite}
start=$(date +%s)
if [[ "${SKIP_WHEELS:-0}" != 1 ]]; then
  if [[ ! -d "$site/lm_eval" ]]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .device-carry/evalwhl/*.whl
  fi
  export PYTHONPATH="$root/src:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export WIDE_SMOLLM2_GGUF=${WIDE_SMOLLM2_GGUF:-$HOME/.cache/wide/SmolLM2-135M-Instruct.Q4_1.gguf}
export WIDE_DATA=${WIDE_DATA:-$root/shared/data}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
[[ -f "$WIDE_SMOLLM2_GGUF" ]] || { echo "no GGUF at $WIDE_SMOLLM2_GGUF" >&2; exit 2; }
[[ -f "$WIDE_DATA/SOURCES.md" ]] || { echo "no data at $WIDE_DATA" >&2; exit 2; }
"$py" - "$out" <<'PY' 2>&1 | tee "$out/log.txt"
import os, sys, time
import torch
from wide.eval.runner import run_eval

out = sys.argv[1]
e = os.environ.get
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
t0 = time.time()
res = run_eval("smollm2-135m", [], e("TASKS", "all"), limit=int(e("LIMIT")) if e("LIMIT") else None,
               batch_size=int(e("BATCH_SIZE", "64")), max_length=int(e("MAX_LENGTH", "4096")),
               dtype=e("DTYPE", "bfloat16"), device=e("DEVICE", "cuda"), out=os.path.join(out, "dense"))
print(res["markdown"])
print(f"run_eval wall {time.time() - t0:.1f} s")
PY
echo "total wall $(( $(date +%s) - start )) s" | tee "$out/wall.txt"
