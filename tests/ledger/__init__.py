"""Tests of runs.ledger: the record (claim, lease, journal, effects, reconcile).
"""
