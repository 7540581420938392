#!/usr/bin/env bash
# Builds the git-ignored inputs that GPU-machine calls carry: run on this machine (network), from the repo root.
#   .device-carry/smol.part.*  the SmolLM2 GGUF in parts that each fit a call beside the tree (gguf_parts.sh)
#   .device-carry/evalwhl/  lm-eval 0.4.13 and the pure-python packages the GPU image lacks (it has torch,
#                           transformers, peft, pyarrow, pandas, scikit-learn, sacrebleu, ...: KINDS.md's list),
#                           for CPython 3.12, installed there with --no-deps by setup.sh; gguf included
#   .device-carry/data.tar.xz  the offline data root without tiny-shakespeare (~7 MiB)
#   .device-carry/quality-work/  the quality sweep's seed (seed_work.sh: rows in the tree as names, rows from history ~4.7 MB each)
# Pins: datasets 4.8.x accepts the image's huggingface-hub 1.x; dill / multiprocess / typepy / chardet at the
# versions datasets and pytablewriter accept.
set -euo pipefail
bash scripts/device/gguf_parts.sh
E=.device-carry/evalwhl
rm -rf "$E" && mkdir -p "$E"
P=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
python3 -m pip download -q --no-deps "${P[@]}" -d "$E" lm_eval==0.4.13 datasets==4.8.5 evaluate==0.4.6 \
  dill==0.4.0 multiprocess==0.70.18 pytablewriter dataproperty mbstrdecoder pathvalidate tabledata tcolorpy \
  typepy==1.3.5 "chardet<7" rouge_score nltk more_itertools gguf==0.19.0
python3 -m pip wheel -q --no-deps -w "$E" sqlitedict word2number  # source-only on PyPI, pure python
grep -qx "/.device-carry/" .git/info/exclude 2>/dev/null || echo "/.device-carry/" >>.git/info/exclude
tar -cJf .device-carry/data.tar.xz -C "${WIDE_SHARED:-../shared}" --exclude=data/tinyshakespeare data
du -sh "$E" .device-carry/data.tar.xz
bash scripts/device/seed_work.sh
