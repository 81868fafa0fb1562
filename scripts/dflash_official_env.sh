#!/usr/bin/env bash
# The official DFlash implementation in its OWN environment, for the drafter parity test
# (tests/engine/reference/test_dflash_parity.py, live part) and for regenerating its pinned fixture
# (python scripts/dflash_parity.py fixture --official-python DEST/bin/python).
# `dflash` (PyPI, MIT, by the DFlash authors) cannot share the project's environment: its base install pins
# tqdm==4.70.0 and datasets==5.0.1 (which needs huggingface_hub<2), so pip would downgrade two installed
# packages; its [local] extra pins torch==2.13.0 and transformers==5.15.0. Here it gets exactly its own pins.
set -euo pipefail
dest="${1:-.cache/dflash-official}"
python="${PYTHON:-python3}"
[ -x "$dest/bin/python" ] || "$python" -m venv "$dest"
TORCH_CPU_SPEC="torch==2.13.0" TORCH_GPU_SPEC="torch==2.13.0" "$(dirname "$0")/install_torch.sh" "$dest/bin/python"
"$dest/bin/python" -m pip install -q "dflash[local]==0.1.0"
"$dest/bin/python" -c "import dflash.model, torch, transformers; print('official dflash env:', torch.__version__, transformers.__version__)"
