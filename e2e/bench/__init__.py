"""Benchmarks: each prints its figures beside baselines measured in the same run.

Run them as modules (`python -m e2e.bench.control_plane`); they are not
tests and pytest does not collect them.
"""
