"""Engines: everything that touches torch (and transformers, NVTX, NVML) lives under this package.

Importing ``pd_dflash.engine``, ``.interface``, ``.registry`` or an engine's ``options`` module never imports
torch; the CLI and the Ray driver rely on that.
"""
