# Sourced by the GPU checks: run from the repository root with its Python.
#   PY: the interpreter (first argument, default .venv/bin/python).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${1:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

# has_gpu: true when TensorFlow sees a GPU.
has_gpu() {
  "$PY" -c 'import sys, tensorflow as tf
sys.exit(0 if tf.config.list_physical_devices("GPU") else 1)' 2>/dev/null
}
