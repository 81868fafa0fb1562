"""The reference engine's tiny presets and their training: the synthetic language, the preset catalogue,
deterministic cached training of targets and of their DFlash drafters (the published layout, one per block size;
one training loop for both). Nothing here runs per cell; the
per-cell runtime (``engine/reference/``) only loads what these modules built."""
