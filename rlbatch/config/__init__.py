"""Configuration: the typed schema (``schema``, with its ``bounds`` and the sandbox's ``limits``),
its registration with Hydra (``register``), plain-mapping helpers (``plain``) and ``load``.

The bottom layer: it imports nothing of rlbatch outside this package, and every package may import
it. Validation, which asks placement, engines and the planner, is ``rlbatch.checks`` above them.
"""
