"""Tests of runs.rules: replay, resume, who may act for whom, what failed runs say.
"""
