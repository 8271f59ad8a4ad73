#!/usr/bin/env bash
# GPU check of configs/facenet_1800.yaml (Inception-ResNet-v1, 160 px, P x K = 45 x 40 = 1,800
# images, bf16, chunks of 128, channels_last) on one GPU, in at most 8 minutes on one H100:
#   default, chunked   CUDA peak allocated and reserved bytes, images/s of the default step
#                      (no train.chunk_size) and the chunked one, on the run's own trainer
#   seed_largest       the seed's loop at 600, 1,200 and 1,800 images (3 T), up to the first
#                      that does not fit
#   ours_at_seed_batch ours (default and chunked) at the seed's largest batch that fits
#   ours_at_1800       ours at 1,800
#   sync_debug         one step of each path (one-pass, two-pass, chunked) under
#                      torch.cuda.set_sync_debug_mode("warn"): the syncs CUDA reports
#   cuda_tests         the tests a CPU machine skips (pytest, where installed)
# Writes ${OUT:-.}/gpu_check.json after every measurement (a time limit keeps what is done).
#
#   bash benchmarks/gpu_check.sh
#   OUT=/tmp/gpu PYTHON=/usr/bin/python3 bash benchmarks/gpu_check.sh
#
# Runs from the checkout on a bare machine: python3 with torch >= 2.5 (pyproject.toml's floor)
# and the package's runtime dependencies; nothing is installed (PYTHONPATH is the checkout).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the repository root: python -m benchmarks.<name>
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-.}"
LIMIT_S="${LIMIT_S:-450}"  # the whole check, starts of the measured processes included
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# One interpreter start: torch importable and at the floor, a CUDA device visible, its name.
if ! info=$("$PY" - <<'PYTHON'
import sys

try:
    import torch
except Exception as err:  # a broken or missing installation
    print(f"cannot import torch ({err}); set PYTHON=/path/to/python")
    sys.exit(3)
version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if version < (2, 5):
    print(f"torch {torch.__version__} is below the floor 2.5 (pyproject.toml)")
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
timeout --signal=INT --kill-after=20 "$LIMIT_S" \
  "$PY" -m benchmarks.bench_training_step --suite facenet1800 --device cuda \
  --json "$OUT_DIR/gpu_check.json" || status=$?
if [[ $status -ne 0 ]]; then
  echo "gpu_check.sh: stopped with status $status (124: over ${LIMIT_S}s); the measurements" \
    "finished before that are in $OUT_DIR/gpu_check.json" >&2
fi
date
exit "$status"
