#!/usr/bin/env bash
# GPU check: CUDA peak allocated memory and images/s of the seed loop, the two-pass step and the
# one-pass step on resnet50 at 160 px (triplet batch 3 x 128, and P x K = 64 x 4 = 256), with and
# without bf16 autocast; then the largest P x K that fits with and without gradient caching.
# At most 8 minutes on one GPU. Prints a table; writes gpu_check.json and gpu_search.json into
# ${OUT:-.}.
#
#   bash benchmarks/gpu_check.sh
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#   python -m benchmarks.run_all --tables-only --gpu-json gpu_check.json gpu_search.json
#
# The work is done by python -m benchmarks.bench_training_step --suite gpu, which runs on a CPU too
# (with --device cpu --quick for a smoke test); this script only refuses to start
# without CUDA and bounds the time.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the repository root: python -m benchmarks.<name>
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR="${OUT:-.}"
SUITE_LIMIT_S="${SUITE_LIMIT_S:-360}"   # the table
SEARCH_LIMIT_S="${SEARCH_LIMIT_S:-100}"  # the largest P x K

# One interpreter start: torch importable, a CUDA device visible, its name.
if ! info=$("$PY" - <<'PYTHON'
import sys

try:
    import torch
except Exception as err:  # a broken or missing installation
    print(f"cannot import torch ({err}); set PYTHON=/path/to/python")
    sys.exit(3)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device; nothing measured")
    sys.exit(2)
props = torch.cuda.get_device_properties(0)
print(
    f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; "
    f"torch {torch.__version__}, CUDA {torch.version.cuda}"
)
PYTHON
); then
  echo "gpu_check.sh: $info" >&2
  exit 2
fi
echo "$info"
mkdir -p "$OUT_DIR"
date

status=0
timeout --signal=INT --kill-after=20 "$SUITE_LIMIT_S" \
  "$PY" -m benchmarks.bench_training_step --suite gpu --json "$OUT_DIR/gpu_check.json" \
  || status=$?
if [[ $status -ne 0 ]]; then
  echo "gpu_check.sh: the suite stopped with status $status (124: over ${SUITE_LIMIT_S}s);" \
    "the cases finished before that are in $OUT_DIR/gpu_check.json" >&2
fi

search_status=0
timeout --signal=INT --kill-after=20 "$SEARCH_LIMIT_S" \
  "$PY" -m benchmarks.bench_training_step --suite gpu --only-search \
  --pk-search 512,1024,2048,4096,8192 --json "$OUT_DIR/gpu_search.json" \
  || search_status=$?
if [[ $search_status -ne 0 ]]; then
  echo "gpu_check.sh: the P x K search stopped with status $search_status" >&2
fi
date
exit "$status"
