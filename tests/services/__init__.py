"""Tests of runs.services.run: decisions on calls (approve, settle) and cancelling.
"""
