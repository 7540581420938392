#!/usr/bin/env bash
# The last lines of each quality row's log (WORK/NAME/log.txt), carriage-return progress bars split into lines.
# Usage: bash scripts/device/row_tails.sh WORK > quality-tails.txt
for f in "${1:?usage: row_tails.sh WORK}"/*/log.txt; do
  [ -f "$f" ] || continue
  echo "--- $f"
  tr '\r' '\n' <"$f" | grep -v '^[[:space:]]*$' | tail -n 12 | cut -c1-300
done
