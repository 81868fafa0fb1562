"""The Ray orchestrator: driver, runner pool and actors, health policy, collector, preflight, progress.

Ray is imported only inside this package, and only by the modules that need it (``cluster``, ``driver``,
``pool``, ``health``, ``sink``, ``runner``, ``collector``, ``preflight``). ``options``, ``store``, ``resume``,
``placement``, ``progress`` and ``manifest`` are pure, so ``pd_dflash.sweep.resume.current_rows`` (the
de-duplicated view of a sweep directory) can be used without Ray.
"""
