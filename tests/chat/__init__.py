"""Tests of runs.chat and its API door.
"""
