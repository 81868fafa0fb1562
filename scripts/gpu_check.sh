#!/usr/bin/env bash
# The prepared GPU check for a CUDA box (one device call: at most 540 s of steps, 590 s hard limit): device probe, the reference engine's CUDA path on a mini
# preset (offloaded vs resident outputs identical, measured transfers vs probe), the real-checkpoint steps (tiny
# real-layout targets, a real-shaped slice's expert transfers vs the probe, a real target when its weights are under
# HF_HOME) and `pytest -m gpu` (the link's ordering, timing and memory tests on 64 MiB experts, every configuration
# on CUDA; their figures in the summary).
#
#   scripts/gpu_check.sh [SUMMARY.json] [--steps a,b] [--budget-s S]
#                                               # default: $OUT/gpu_check.json, else ./gpu_check.json; all steps
#                                               # in order (probe, reference, gpu_tests, real_tiny, real_slice,
#                                               # real_target) within the budget; a step past it is "not run".
#   Two calls cover everything when one is not enough:
#     scripts/gpu_check.sh $OUT/a.json --steps probe,reference,gpu_tests
#     scripts/gpu_check.sh $OUT/b.json --steps probe,real_tiny,real_slice,real_target
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
summary="${OUT:-.}/gpu_check.json"
if [[ $# -gt 0 && "$1" != --* ]]; then
  summary="$1"
  shift
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PD_DFLASH_CACHE="${PD_DFLASH_CACHE:-$PWD/.cache/pd-dflash}"

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "gpu_check: nvidia-smi not found (no NVIDIA driver?)"
exec timeout 590 "$py" benchmarks/gpu_check.py --output "$summary" "$@"
