#!/usr/bin/env bash
# Seed a fresh GPU machine's quality work from the repository instead of parts that came back from one: run
# here (it reads git history), before the call that starts quality.sh / quality_bg.sh, and carry
# .device-carry/quality-work in that call. Rows seeded (their stage 1 only, as shipped):
#   wide-25-long             smollm2-135m-s25 as shipped until 96649fe (git f043025: the 4,000-step routers)
#   wide-25-long-warm-kllm   src/wide/checkpoints/smollm2-135m-s25 (shipped since: 4,000 + 2,500)
#   wide-50-long             smollm2-135m-s50 as shipped until 62ca804 (git 839dbe2: the 4,000-step routers)
#   wide-50-long-warm-kllm   smollm2-135m-s50 as shipped from 62ca804 to 71fd77b (git d827a05: 4,000 + 3,000)
#   wide-50-long-warm2-kllm  smollm2-135m-s50 as shipped until d52880f (git d52880f: 4,000 + 3,000 + 2,500)
#   wide-50-long-g32-warm-kllm  src/wide/checkpoints/smollm2-135m-s50 (shipped since: G_ffn 32, 4,000 + 1,500)
# and the records file bench/results/quality/smollm2/quality-h200.json; restore_work.sh (run by setup.sh and quality.sh)
# restores both from .device-carry/quality-work/ and quality.sh skips every row with a finished record. A row
# whose checkpoint is in the tree travels as one line of tree-rows.txt (restored from src/wide/checkpoints/); a
# row from history as work.tar.00 (~4.7 MB a row: a call carries 64 MiB with the ~40 MiB tree and evalwhl).
#   ROWS="NAME ..."   seed only these rows (default: all six)
#   DROP=NAME[,NAME]  records removed first, so that those rows run again (e.g. a LoRA row whose adapter
#                     never came back)
#   FROM=DIR KEEP="NAME ..."  also these rows from a run's returned parts (DIR/work.tar.*: an interrupted row's
#                     latest checkpoint, which the next machine resumes)
#   SEED_OUT=DIR      write there instead of .device-carry/quality-work (tests)
# Usage (repo root, this machine): ROWS=... DROP=... bash scripts/device/seed_work.sh
set -eu
Q=${SEED_OUT:-.device-carry/quality-work}
T=$(mktemp -d)
rm -rf "$Q" && mkdir -p "$Q"
ROWS=${ROWS:-wide-25-long wide-25-long-warm-kllm wide-50-long wide-50-long-warm-kllm wide-50-long-warm2-kllm
  wide-50-long-g32-warm-kllm}
seed() {  # seed ROW GIT_REV CHECKPOINT_NAME, if ROWS names it
  case " $ROWS " in *" $1 "*) ;; *) return 0 ;; esac
  if [ "$2" = HEAD ]; then
    git diff --quiet HEAD -- "src/wide/checkpoints/$3" || { echo "src/wide/checkpoints/$3 differs from HEAD" >&2; exit 1; }
    echo "$1 $3" >>"$Q/tree-rows.txt"
    return 0
  fi
  mkdir -p "$T/$1/stage1"
  for f in routers.safetensors wide_config.json train_log.jsonl; do
    git show "$2:src/wide/checkpoints/$3/$f" >"$T/$1/stage1/$f"
  done
}
seed wide-25-long f043025 smollm2-135m-s25
seed wide-25-long-warm-kllm HEAD smollm2-135m-s25
seed wide-50-long 839dbe2 smollm2-135m-s50
seed wide-50-long-warm-kllm d827a05 smollm2-135m-s50
seed wide-50-long-warm2-kllm d52880f smollm2-135m-s50
seed wide-50-long-g32-warm-kllm HEAD smollm2-135m-s50
if [ -n "${FROM:-}" ]; then
  for n in ${KEEP:?name the rows to keep from FROM}; do
    cat "$FROM"/work.tar.* | tar -xf - -C "$T" "$n" || { echo "$n is not in $FROM/work.tar.*" >&2; exit 1; }
  done
fi
[ -z "$(ls "$T")" ] || tar -cf "$Q/work.tar.00" -C "$T" .
rm -rf "$T"
python3 - "$Q/quality.json" "${DROP:-}" <<'PY'
import json, sys
out, drop = sys.argv[1], set(filter(None, sys.argv[2].split(",")))
data = json.load(open("bench/results/quality/smollm2/quality-h200.json"))
data["records"] = [r for r in data["records"] if r.get("name") not in drop]
json.dump(data, open(out, "w"), indent=1)
print(f"seeded {out}: {len(data['records'])} records, dropped {sorted(drop)}")
PY
du -sh "$Q"
