"""Real checkpoints for the reference engine: resolving them offline, checking them without torch, streaming
their experts into the host store, MXFP4, and tiny checkpoints in the real layouts.

``files``, ``resolve``, ``layouts`` and ``check`` import neither torch nor transformers (``pd-dflash plan``
uses them); ``mxfp4``, ``loader`` and ``tiny`` need torch.
"""
