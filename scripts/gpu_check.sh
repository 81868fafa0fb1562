#!/usr/bin/env bash
# The prepared GPU check: ONE device call of at most 480 s on a bare CUDA box without network (docs/gpu-check.md).
#
#   scripts/gpu_check.sh [SUMMARY.json] [--cpu] [--steps a,b] [--budget-s S]
#       default summary: $OUT/gpu_check.json, else ./gpu_check.json; rewritten after every step.
#       steps (time-boxed, 440 s in all): bundle, preflight, link_tests, configurations, configuration_tests,
#       overhead, pinning, real_size; real_slice and real_target only when named (a second call).
#       --cpu: every step's CPU-runnable part with the same code (CI: tests/engine/reference/test_gpu_check.py).
#       --budget-s: whole seconds (a plain decimal number) from 10 to 7200; default 440, with --cpu 1320.
#
# Bad arguments exit 2 with the summary saying why (nothing runs). Interpreter: $PYTHON, else .venv/bin/python,
# else python3 (the lent image's, with its CUDA torch). The packages the image lacks come from .whl/
# (scripts/gpu_bundle.sh), installed into a temporary directory by the bundle step; the trained presets from
# .cache/gpu-bundle/pd-dflash when it exists. Nothing is downloaded; Ray is never needed.
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
if [[ $# -gt 0 && "$1" != -* ]]; then
  summary="$1"
  shift
fi
usage="usage: scripts/gpu_check.sh [SUMMARY.json] [--cpu] [--steps a,b] [--budget-s S]"

json_string() { # a JSON string literal of $1 (backslashes, quotes, control characters escaped)
  local s="${1//\\/\\\\}"
  s="${s//\"/\\\"}"
  s="${s//$'\n'/\\n}"
  s="${s//$'\t'/\\t}"
  printf '"%s"' "$(printf '%s' "$s" | tr -d '\000-\037')"
}

refuse() { # the summary says why; exit 2 (bad input), nothing else runs
  local why="gpu_check: $1"
  echo "$why" >&2
  echo "$usage" >&2
  local dir
  dir="$(dirname -- "$summary")"
  if mkdir -p -- "$dir" 2>/dev/null; then
    printf '{\n  "ok": false,\n  "error": %s,\n  "usage": %s,\n  "steps": {}\n}\n' \
      "$(json_string "$why")" "$(json_string "$usage")" >"$summary.tmp" 2>/dev/null &&
      mv -f -- "$summary.tmp" "$summary" || echo "gpu_check: could not write $summary" >&2
  fi
  exit 2
}

cpu=0 budget="" steps=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  arg="${args[$i]}"
  case "$arg" in
  --cpu) cpu=1 ;;
  --steps | --budget-s)
    if ((i + 1 >= ${#args[@]})) || [[ "${args[$((i + 1))]}" == --* || -z "${args[$((i + 1))]}" ]]; then
      refuse "$arg needs a value"
    fi
    i=$((i + 1))
    if [[ "$arg" == --steps ]]; then steps="${args[$i]}"; else budget="${args[$i]}"; fi
    ;;
  -h | --help)
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *) refuse "unknown argument '$arg' (the summary path, if given, comes first)" ;;
  esac
done
if [[ -n "$steps" && ! "$steps" =~ ^[a-z_]+(,[a-z_]+)*$ ]]; then
  refuse "--steps takes comma-separated step names, got '$steps'"
fi
if [[ -n "$budget" ]]; then
  if [[ ! "$budget" =~ ^[0-9]+$ ]]; then
    refuse "--budget-s takes whole seconds as a plain decimal number (e.g. 440), got '$budget'"
  fi
  if ((${#budget} > 6)); then
    refuse "--budget-s must be from 10 to 7200 seconds, got $budget"
  fi
  budget=$((10#$budget))
  if ((budget < 10 || budget > 7200)); then
    refuse "--budget-s must be from 10 to 7200 seconds, got $budget"
  fi
else
  budget=$((cpu ? 1320 : 440)) # benchmarks/gpu_check.py: the steps' budgets; --cpu stretches them by 3
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [[ -z "${PD_DFLASH_CACHE:-}" ]]; then
  if [[ -d .cache/gpu-bundle/pd-dflash ]]; then
    export PD_DFLASH_CACHE="$PWD/.cache/gpu-bundle/pd-dflash"
  else
    export PD_DFLASH_CACHE="$PWD/.cache/pd-dflash"
  fi
fi
command -v "$py" >/dev/null || refuse "no Python interpreter '$py' (set PYTHON)"

forward=(--output "$summary" --budget-s "$budget")
((cpu)) && forward+=(--cpu)
[[ -n "$steps" ]] && forward+=(--steps "$steps")
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "gpu_check: nvidia-smi not found (no NVIDIA driver?)"
# The hard limit: the step budgets plus 30 s for the interpreter, the summary and the last step's clean-up.
exec timeout "$((budget + 30))" "$py" benchmarks/gpu_check.py "${forward[@]}"
