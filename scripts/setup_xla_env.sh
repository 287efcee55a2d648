#!/usr/bin/env bash
# Build the virtual environment that scripts/check_xla.py runs in, beside the main one:
# torch and torch_xla 2.9 (a pair torch_xla publishes; the main environment's newer torch
# has no torch_xla), then this project editable without letting pip touch that torch.
#
#   scripts/setup_xla_env.sh [VENV]      # default: $XLA_VENV or ~/.cache/p2pdiloco/xla-venv
#   VENV/bin/python scripts/check_xla.py  # XLA's CPU backend (PJRT_DEVICE=CPU) unless on a TPU
#
# About 7 GB and 2-3 minutes from PyPI (the torch wheel carries CUDA libraries). A venv
# that already has the pair is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${XLA_VENV:-$HOME/.cache/p2pdiloco/xla-venv}}
PYTHON=${PYTHON:-python3.11}
TORCH_XLA_VERSION=${TORCH_XLA_VERSION:-2.9.0}
TORCH_XLA_EXTRAS=${TORCH_XLA_EXTRAS:-}  # "tpu" on a TPU VM (adds libtpu)
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch_xla" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==$TORCH_XLA_VERSION" \
    "torch_xla${TORCH_XLA_EXTRAS:+[$TORCH_XLA_EXTRAS]}==$TORCH_XLA_VERSION"
fi
# The project's range for torch admits this one, so pip keeps it; the rest are its deps.
"$VENV/bin/pip" install -q -e . pytest pytest-timeout
"$VENV/bin/python" - <<'PY'
import torch, torch_xla
assert torch.__version__.split("+")[0] == torch_xla.__version__.split("+")[0], (
    f"torch {torch.__version__} and torch_xla {torch_xla.__version__} must be one release"
)
print(f"xla env ready: torch {torch.__version__}, torch_xla {torch_xla.__version__}")
PY
echo "run: $VENV/bin/python scripts/check_xla.py"
