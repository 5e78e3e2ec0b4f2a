#!/usr/bin/env bash
# The checks a lent GPU can run without vLLM (bench/gpu_check.py): the fused log-prob
# kernel on CUDA, a sharded training step over NCCL, trainer-state offload and restore,
# the ordering of weights leaving the trainer. One table; a few minutes on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout 480 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m bench.gpu_check "$@"
