#!/usr/bin/env bash
# Sourced at the start of every GPU-machine call: assembles the SmolLM2 GGUF (carried in parts, one per
# call: .device-carry/smol.part.aa, .ab, ... from gguf_parts.sh), installs carried wheels, unpacks the
# offline data, restores carried quality work (restore_work.sh).
# Leaves WIDE_SMOLLM2_GGUF, WIDE_DATA and PYTHONPATH exported.
C=$HOME/.cache/wide
mkdir -p "$C"
G=$C/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ]; then
  # keep this call's part; the GGUF exists once the parts kept so far hash to it (any number of parts)
  for p in .device-carry/smol.part.*; do [ -f "$p" ] && cp "$p" "$C/"; done
  cat "$C"/smol.part.* >"$G.tmp" 2>/dev/null
  if echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G.tmp" | sha256sum -c --status; then
    mv "$G.tmp" "$G" && echo "assembled $G"
  else
    rm -f "$G.tmp"; echo "GGUF parts so far: $(cd "$C" && ls smol.part.* 2>/dev/null | tr '\n' ' ')"
  fi
fi
# evalwhl (lm-eval and the pure-python packages the GPU image lacks) already holds gguf; else whl.
W=.device-carry/evalwhl; [ -d "$W" ] || W=.device-carry/whl
[ -d "$W" ] && [ ! -d "$C/site/gguf" -o ! -d "$C/site/lm_eval" ] && \
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$C/site" "$W"/*.whl 2>&1 | grep -v WARN
[ -f .device-carry/data.tar.xz ] && [ ! -d "$C/data" ] && tar -xJf .device-carry/data.tar.xz -C "$C"
bash scripts/device/restore_work.sh  # carried quality rows and records -> $HOME/quality (once)
export WIDE_SMOLLM2_GGUF=$G WIDE_DATA=$C/data WIDE_CACHE=$C
export PYTHONPATH=$PWD/src:$C/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ls -la "$C" | head; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
