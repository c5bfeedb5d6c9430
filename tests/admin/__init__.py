"""Tests of runs.admin: the support desk.
"""
