#!/usr/bin/env bash
# The prepared GPU check for a CUDA box (≤ 9.5 minutes): device probe, the reference engine's CUDA path on a mini
# preset (offloaded vs resident outputs identical, measured transfers vs probe) and `pytest -m gpu` (the link's
# ordering, timing and memory tests on 64 MiB experts, every configuration on CUDA; their figures in the summary).
#
#   scripts/gpu_check.sh [SUMMARY.json]        # default: $OUT/gpu_check.json, else ./gpu_check.json
#
# Uses $PYTHON, else .venv/bin/python, else python3; that interpreter needs torch (a CUDA build) and the
# pd-dflash dependencies (`pip install -e .[engine,dev]`). Nothing is downloaded. Results: docs/gpu-check.md.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
summary="${1:-${OUT:-.}/gpu_check.json}"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PD_DFLASH_CACHE="${PD_DFLASH_CACHE:-$PWD/.cache/pd-dflash}"

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "gpu_check: nvidia-smi not found (no NVIDIA driver?)"
exec timeout 570 "$py" benchmarks/gpu_check.py --output "$summary" "${@:2}"
