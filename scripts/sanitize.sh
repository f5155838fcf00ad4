#!/usr/bin/env bash
# Run the representative kernel calls under compute-sanitizer's memcheck, racecheck and synccheck.
# Needs a GPU and compute-sanitizer on PATH (or under /usr/local/cuda/bin).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
python3 scripts/sanitize_cases.py >/dev/null  # compile outside the sanitizer
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
status=0
for tool in memcheck racecheck synccheck; do
  echo "== $tool (full log: $LOG_DIR/sanitize-$tool.log)"
  "$CS" --tool "$tool" --error-exitcode 1 python3 scripts/sanitize_cases.py > "$LOG_DIR/sanitize-$tool.log" 2>&1 || status=1
  tail -2 "$LOG_DIR/sanitize-$tool.log"
done
exit $status
