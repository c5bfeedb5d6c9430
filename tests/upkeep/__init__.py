"""Tests of runs.upkeep: recovery, retention, metrics.
"""
