#!/usr/bin/env bash
# Install torch into the given interpreter's environment without ever pulling a multi-GB CUDA build by accident.
#  - torch already importable (a GPU box's CUDA build, or a previous run): keep it.
#  - an NVIDIA driver is present (nvidia-smi works): install the default build from the index (CUDA).
#  - otherwise (CPU machine): install the CPU wheel pinned by TORCH_CPU_SPEC (torch==2.13.0 lies on disk here).
set -euo pipefail
py="${1:?usage: install_torch.sh PYTHON}"
TORCH_CPU_SPEC="${TORCH_CPU_SPEC:-torch==2.13.0}"
TORCH_GPU_SPEC="${TORCH_GPU_SPEC:-torch>=2.4}"
if "$py" -c "import torch" >/dev/null 2>&1; then
    echo "install_torch: keeping $("$py" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install_torch: NVIDIA driver found, installing $TORCH_GPU_SPEC"
    "$py" -m pip install -q "$TORCH_GPU_SPEC"
else
    echo "install_torch: no GPU, installing $TORCH_CPU_SPEC (CPU build)"
    "$py" -m pip install -q "$TORCH_CPU_SPEC"
fi
