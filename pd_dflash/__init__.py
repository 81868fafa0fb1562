"""pd-dflash: a Ray-based sweep orchestrator for the PD-DFlash Phase-A benchmark matrix.

The package is layered (see docs/architecture.md): the pure core (spec, schema, report, cost model) imports
neither torch nor Ray; torch lives under ``pd_dflash.engine`` and Ray under ``pd_dflash.sweep``.
"""

__version__ = "0.1.0"
