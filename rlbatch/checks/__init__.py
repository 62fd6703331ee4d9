"""Validation before anything starts: ``check(cfg)`` (``validate``) over the schema (``rlbatch.config``),
the placement, the engines' own rules, the planner's fit and what this machine can run.

It sits above the packages it asks (placement, engines, plan, data, envs, trackers); ``rlbatch.config``
below them all imports nothing of rlbatch but the errors (docs/architecture.md, "Layers").
"""
