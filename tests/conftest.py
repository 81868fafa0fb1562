"""Shared test settings. Ray tests must never leave a token behind or phone home; nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Trained reference presets are deterministic and cached; keep the cache inside the checkout (git-ignored).
os.environ.setdefault("PD_DFLASH_CACHE", str(REPO / ".cache" / "pd-dflash"))
