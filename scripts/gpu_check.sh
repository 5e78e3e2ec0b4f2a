#!/usr/bin/env bash
# The checks a lent GPU can run without vLLM (bench/gpu_check.py): the fused log-prob
# kernel, a sharded step and finish_step over NCCL, the hand-off to vLLM (offload and
# empty_cache), an IPC bucket round trip, the memory plan's trainer rows against the
# allocator; where vLLM is installed, the colocated judge's engine arguments against it,
# every engine of a 14B elastic judged run through vLLM's own config validation, an asleep
# layout's real residue against the plan's price, and a judge's wake with streamed layers.
# Then, as information that never fails the run, whether CUDA MPS is on (the colocated
# judge's kernels run beside the rollout's under it). One table; exit 1 on a mismatch;
# a few minutes on one GPU. `--dry` runs the same code on CPU over gloo (the suite does).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout 480 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m bench.gpu_check "$@"
