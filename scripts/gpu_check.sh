#!/usr/bin/env bash
# The prepared GPU check: ONE device call of at most 480 s on a bare CUDA box without network (docs/gpu-check.md).
#
#   scripts/gpu_check.sh [SUMMARY.json] [--cpu] [--steps a,b] [--budget-s S]
#       default summary: $OUT/gpu_check.json, else ./gpu_check.json; rewritten after every step.
#       steps (time-boxed, 440 s in all): bundle, preflight, link_tests, configurations, configuration_tests,
#       overhead, pinning; real_slice and real_target only when named (a second call).
#       --cpu: every step's CPU-runnable part with the same code (CI: tests/engine/reference/test_gpu_check.py).
#
# Interpreter: $PYTHON, else .venv/bin/python, else python3 (the lent image's, with its CUDA torch). The packages
# the image lacks come from .whl/ (scripts/gpu_bundle.sh), installed into a temporary directory by the bundle step;
# the trained presets from .cache/gpu-bundle/pd-dflash when it exists. Nothing is downloaded; Ray is never needed.
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
budget=440 # benchmarks/gpu_check.py: the steps' budgets; --cpu stretches them by 3
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ "${args[$i]}" == --cpu ]] && budget=1320
done
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ "${args[$i]}" == --budget-s ]] && budget="${args[$((i + 1))]}"
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [[ -z "${PD_DFLASH_CACHE:-}" ]]; then
  if [[ -d .cache/gpu-bundle/pd-dflash ]]; then
    export PD_DFLASH_CACHE="$PWD/.cache/gpu-bundle/pd-dflash"
  else
    export PD_DFLASH_CACHE="$PWD/.cache/pd-dflash"
  fi
fi

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "gpu_check: nvidia-smi not found (no NVIDIA driver?)"
# The hard limit: the step budgets plus 30 s for the interpreter, the summary and the last step's clean-up.
exec timeout "$((${budget%.*} + 30))" "$py" benchmarks/gpu_check.py --output "$summary" "$@"
