"""The reference engine's tiny presets and their training: the synthetic language, the preset catalogue,
deterministic cached training of targets and of their DFlash-style drafters. Nothing here runs per cell; the
per-cell runtime (``engine/reference/``) only loads what these modules built."""
