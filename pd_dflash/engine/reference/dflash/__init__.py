"""DFlash drafters in the layout z-lab publishes (``z-lab/Qwen3-Coder-30B-A3B-DFlash``, ``z-lab/gpt-oss-20b-DFlash``).

``config`` reads a drafter's ``config.json`` and checks it against its target's, without torch (``pd-dflash
plan`` calls :func:`~pd_dflash.engine.reference.dflash.config.check_drafter`); ``model`` is the drafter itself
(plain torch), ``source`` drives it from the decode loop (per-request drafter KV, c requests drafted together),
``tiny`` writes tiny random drafters in the published layout for tests and ``jobs/tiny_real.yaml`` (and, with
``save_drafter``, the presets' trained drafters: ``presets/drafters.py``). Every drafter the engine runs — published
or a preset's — goes through ``load`` and ``source``.
"""
