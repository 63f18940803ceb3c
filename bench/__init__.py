"""Sluice benchmark suite: load generators, an in-process baseline and reports.

Run ``python -m bench --help``; see ``bench/RESULTS.md`` for the published numbers.
"""
