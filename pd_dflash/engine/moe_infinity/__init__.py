"""Adapter from the engine interface to MoE-Infinity (``engine: moe_infinity``).

This ``__init__`` stays free of torch and of moe_infinity; the adapter class lives in
``pd_dflash.engine.moe_infinity.engine``.
"""
