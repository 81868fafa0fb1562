"""An engine implementation module that cannot be imported (used by the preflight tests)."""

raise ImportError("pd-dflash test: this engine module is broken on purpose")
