#!/usr/bin/env bash
# The CUDA device check as one prepared command for a lent GPU machine whose image has
# torch but not our other dependencies: wheels for those travel in .whl/ (see
# docs/benchmarks.md, "Accelerators"). Writes $OUT/cuda.json and $OUT/check_cuda.log.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, hivemind, p2pdiloco; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
PYTHONUNBUFFERED=1 timeout "${CHECK_TIMEOUT_S:-480}" python3 scripts/check_cuda.py "$@" \
  --json "$OUT/cuda.json" 2>&1 | tee "$OUT/check_cuda.log"
