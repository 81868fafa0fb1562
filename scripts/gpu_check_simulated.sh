#!/usr/bin/env bash
# The lent GPU image, simulated here (docs/gpu-check.md): CPython 3.12, torch 2.11.0 from the registry, transformers
# 5.17, no pydantic, no Ray; then the bundle (scripts/gpu_bundle.sh), the travelling tree, and
# `scripts/gpu_check.sh --cpu` with the network cut (`unshare -n` where it works, and PIP_NO_INDEX=1 always).
#
#   scripts/gpu_check_simulated.sh [WORK_DIR]      default WORK_DIR: /tmp/pd-dflash-sim
#
# Environment: PY312 (the 3.12 interpreter; default: the newest pyenv 3.12), TORCH_WHEEL (a local torch 2.11.0
# wheel; default: `pip download torch==2.11.0` — the registry's Linux wheel is a CUDA build, so its nvidia-*
# dependencies come too, ≈ 3 GB, once: the venv is kept in WORK_DIR and reused), KEEP_BUNDLE=1 (reuse .whl/ and
# .cache/gpu-bundle/ when they are there). Exit: the check's (0 = ok: true).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
work="${1:-/tmp/pd-dflash-sim}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
py312="${PY312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1)}"
[[ -x "$py312" ]] || { echo "gpu_check_simulated: no Python 3.12 (set PY312; pyenv versions)" >&2; exit 2; }

# 1. The image: a venv with only its packages at its versions (kept between runs: the download is large).
bare="$work/bare"
if [[ ! -f "$bare/.image-ready" ]]; then
  rm -rf "$bare"
  "$py312" -m venv "$bare"
  torch_spec="${TORCH_WHEEL:-torch==2.11.0}"
  "$bare/bin/python" -m pip install -q "$torch_spec" "setuptools<82"
  "$bare/bin/python" -m pip install -q transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0 numpy pandas pyyaml nvidia-ml-py pytest \
    pytest-timeout hypothesis
  # The image has no pydantic and no Ray: whatever pulled them in, they go.
  "$bare/bin/python" -m pip uninstall -q -y pydantic pydantic_core typing-inspection annotated-types ray 2>/dev/null || true
  touch "$bare/.image-ready"
fi
"$bare/bin/python" - <<'EOF'
import importlib.util, sys
import torch, transformers
print(f"image: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA build {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
present = [m for m in ("pydantic", "ray") if importlib.util.find_spec(m)]
sys.exit(f"gpu_check_simulated: the image must not have {present}" if present else 0)
EOF

# 2. The bundle, built here for the image (network still on).
if [[ "${KEEP_BUNDLE:-0}" != 1 || ! -d .whl || ! -d .cache/gpu-bundle ]]; then
  scripts/gpu_bundle.sh --python-version 3.12 --torch 2.11.0
fi

# 3. The tree the device tool carries: tracked and untracked-not-ignored files, plus the bundle.
tree="$work/tree"
rm -rf "$tree" "$work/out" "$work/home" && mkdir -p "$tree/.cache" "$work/out" "$work/home"
git ls-files -z -co --exclude-standard | xargs -0 -I{} sh -c 'test -e "{}" && echo "{}"' |
  tar -c -T - | tar -x -C "$tree"
cp -r .whl "$tree/" && cp -r .cache/gpu-bundle "$tree/.cache/"
echo "tree: $(du -sb "$tree" | cut -f1) B with the bundle"

# 4. The check, network cut.
cut=()
unshare -n true 2>/dev/null && cut=(unshare -n)
echo "network: ${cut[*]:-PIP_NO_INDEX=1 only (unshare -n is not available)}"
cd "$tree"
start=$(date +%s)
set +e
env -u PD_DFLASH_CACHE -u PYTHONPATH -u VIRTUAL_ENV PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS= \
  PYTHON="$bare/bin/python" HOME="$work/home" "${cut[@]}" scripts/gpu_check.sh "$work/out/gpu_check.json" --cpu
rc=$?
set -e
echo "gpu_check_simulated: exit $rc in $(($(date +%s) - start)) s; summary $work/out/gpu_check.json"
"$bare/bin/python" - "$work/out/gpu_check.json" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
print(f"ok: {d.get('ok')}, {d.get('seconds', 0):.0f} s")
for name, s in d.get("steps", {}).items():
    print(f"  {name}: ok={s.get('ok')} {s.get('seconds', 0):.1f} s of {s.get('budget_s', 0):.0f}")
size = d.get("steps", {}).get("real_size", {}).get("result", {})
for name, t in size.get("targets", {}).items():
    e = t.get("engine", {})
    print(f"  real_size {name}: {t.get('layers')} layers, expert_nbytes {e.get('expert_nbytes')}, "
          f"cells {[(c['baseline'], c['concurrency'], c.get('status')) for c in t.get('cells', [])]}")
EOF
cd "$repo"
exit $rc
