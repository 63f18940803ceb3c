"""The builders of the example models of ``model_repository/`` (one module per family).

A Triton-style repository holds models only, so the code that makes their files lives here;
``model_repository/build.py`` is the command that runs it. Every model is produced
deterministically (fixed seeds, a deterministic solver): rebuilding gives the same weights.
"""
