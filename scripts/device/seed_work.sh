#!/usr/bin/env bash
# Seed a fresh GPU machine's quality work from the repository instead of carried parts: the shipped routers
# are the long rows' stage 1 (src/wide/checkpoints/smollm2-135m-s{25,50} = wide-{25,50}-long/stage1), the
# records file is bench/results/smollm2/quality-h200.json. quality.sh then restores both from
# .device-carry/quality-work/ and skips every row with a finished record.
#   DROP=NAME[,NAME]  records removed first, so that those rows run again (e.g. a LoRA row whose adapter
#                     never came back)
# Usage (repo root, before quality.sh / quality_bg.sh start): DROP=... bash scripts/device/seed_work.sh
set -eu
Q=.device-carry/quality-work
T=$(mktemp -d)
mkdir -p "$Q"
for s in 25 50; do
  mkdir -p "$T/wide-$s-long/stage1"
  cp src/wide/checkpoints/smollm2-135m-s$s/* "$T/wide-$s-long/stage1/"
done
tar -cf "$Q/work.tar.00" -C "$T" wide-25-long wide-50-long
rm -rf "$T"
python3 - "$Q/quality.json" "${DROP:-}" <<'PY'
import json, sys
out, drop = sys.argv[1], set(filter(None, sys.argv[2].split(",")))
data = json.load(open("bench/results/smollm2/quality-h200.json"))
data["records"] = [r for r in data["records"] if r.get("name") not in drop]
json.dump(data, open(out, "w"), indent=1)
print(f"seeded {out}: {len(data['records'])} records, dropped {sorted(drop)}")
PY
