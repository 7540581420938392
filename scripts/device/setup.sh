#!/usr/bin/env bash
# Sourced at the start of every GPU-machine call: assembles the SmolLM2 GGUF (carried in two parts,
# see shared/tools/smollm2-to-device.md), installs carried wheels, unpacks the offline data.
# Leaves WIDE_SMOLLM2_GGUF, WIDE_DATA and PYTHONPATH exported.
C=$HOME/.cache/wide
mkdir -p "$C"
[ -f .device-carry/smol.part.aa ] && cp .device-carry/smol.part.aa "$C/"
G=$C/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ] && [ -f .device-carry/smol.part.ab ] && [ -f "$C/smol.part.aa" ]; then
  cat "$C/smol.part.aa" .device-carry/smol.part.ab > "$G"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || rm -f "$G"
fi
# evalwhl (lm-eval and the pure-python packages the GPU image lacks) already holds gguf; else whl.
W=.device-carry/evalwhl; [ -d "$W" ] || W=.device-carry/whl
[ -d "$W" ] && [ ! -d "$C/site/gguf" -o ! -d "$C/site/lm_eval" ] && \
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$C/site" "$W"/*.whl 2>&1 | grep -v WARN
[ -f .device-carry/data.tar.xz ] && [ ! -d "$C/data" ] && tar -xJf .device-carry/data.tar.xz -C "$C"
export WIDE_SMOLLM2_GGUF=$G WIDE_DATA=$C/data WIDE_CACHE=$C
export PYTHONPATH=$PWD/src:$C/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ls -la "$C" | head; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
