"""Reliability scenarios at a reduced count (a package: tests/core has a test_corruption.py too)."""
