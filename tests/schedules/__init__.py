"""Tests of runs.schedules.
"""
