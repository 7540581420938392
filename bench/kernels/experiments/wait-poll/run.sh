#!/usr/bin/env bash
# Experiment (branch exp/wait-poll): how the in-launch wait polls and how tickets are drawn, in the read-floor
# two-phase kernel and the fused FFN. WIDE_WAIT_MODE 0 ld.acquire poll (main), 1 volatile-load poll + one acquire,
# 2 volatile poll with nanosleep back-off; WIDE_PID_TICKET 1: program id as the ticket (no ticket atomic).
set -u
export PYTHONPATH=$PWD/src
mkdir -p "$OUT/runs"
for v in 0,0 1,0 2,0 0,1 1,1 0,0; do
  m=${v%,*}; p=${v#*,}; tag=m$m-p$p
  mkdir -p "$OUT/runs/rf-$tag" "$OUT/runs/ffn-$tag"
  WIDE_WAIT_MODE=$m WIDE_PID_TICKET=$p timeout 90 python3 -m bench.decode.bench_read_floor --out "$OUT/runs/rf-$tag" \
    > "$OUT/runs/rf-$tag/log" 2>&1
  WIDE_WAIT_MODE=$m WIDE_PID_TICKET=$p timeout 120 python3 -m bench.kernels.tune_fused_decode --out "$OUT/runs/ffn-$tag" \
    --kernels ffn --batches 1,16 --grid '[{}, {"ffn_chunk": 16}]' --budget-s 90 > "$OUT/runs/ffn-$tag/log" 2>&1
  mv "$OUT/runs/rf-$tag" "$OUT/runs/rf-$tag-$(date +%s)"; mv "$OUT/runs/ffn-$tag" "$OUT/runs/ffn-$tag-$(date +%s)"
done
python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
res = {}
for d in sorted(glob.glob(f"{out}/runs/*")):
    name = os.path.basename(d)
    res[name] = {"log": open(f"{d}/log").read()[-3000:]}
    for f in glob.glob(f"{d}/*.json"):
        res[name]["json"] = json.load(open(f))
json.dump(res, open(f"{out}/wait-poll.json", "w"), indent=1)
PY
rm -rf "$OUT/runs"
