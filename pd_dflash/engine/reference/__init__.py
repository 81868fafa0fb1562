"""The reference engine: pd-dflash's own offloaded-MoE engine (torch + transformers MoE classes).

This ``__init__`` stays free of torch so that ``options`` can be imported by the pure core; the engine class
lives in ``pd_dflash.engine.reference.engine``.
"""
