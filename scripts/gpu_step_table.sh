#!/usr/bin/env bash
# Issue 42's step table on one lent GPU, in one device call: first the GPU tests of what the
# table's round changed (the graphed step, the torch path's dropout under a capture), then
# benchmarks/step_table.py until STEP_TABLE_DEADLINE_S (default 470 s) from its start.
#
#   device run, kind nvidia-h200, carry [".device"]:  bash scripts/gpu_step_table.sh
#
# Writes $OUT/env.txt, $OUT/tests.log, $OUT/step_table.json and $OUT/step_table.log.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
rm -rf /tmp/plora-tests && mkdir -p /tmp/plora-tests
cp -r tests pyproject.toml /tmp/plora-tests/
status=0
(cd /tmp/plora-tests && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rP \
   ${STEP_TABLE_TESTS:-tests/gpu/test_graphs_gpu.py}) > "$OUT/tests.log" 2>&1 || status=1
tail -3 "$OUT/tests.log"
python3 benchmarks/step_table.py --out "$OUT" --deadline-s "${STEP_TABLE_DEADLINE_S:-470}" \
  ${STEP_TABLE_ARGS:-} 2>&1 | grep -v "^W1\|Warning\|warn" | tee "$OUT/step_table.log"
exit "$status"
