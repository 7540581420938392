#!/usr/bin/env bash
# Splits the SmolLM2 GGUF (98 MB; from ../shared/tools/device-model-parts, or from parts made before) into
# .device-carry/smol.part.aa, .ab, ... so that each part travels beside the working tree within a call's
# 64 MiB (the shipped checkpoints are in the tree, so the part size follows the tree's size). One device call
# per part, back to back; scripts/device/setup.sh keeps each and joins them once their hash matches.
# Run here (not on the GPU machine), from the repo root; again whenever the tree grows.
set -euo pipefail
D=.device-carry
if ! ls $D/smol.part.* >/dev/null 2>&1; then bash "${WIDE_SHARED:-../shared}/tools/device-model-parts" >/dev/null; fi
cat $D/smol.part.* >$D/smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $D/smol.gguf" | sha256sum -c --quiet
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb | tail -1 | cut -f1)
rm -f $D/smol.part.* && split -b $((60 * 1024 * 1024 - tree)) $D/smol.gguf $D/smol.part. && rm $D/smol.gguf
echo "GGUF in $(ls $D/smol.part.* | wc -l) parts (tree $((tree / 1024 / 1024)) MiB): one call each, back to back"
