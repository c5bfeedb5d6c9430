"""Tests of runs.inbox: the webhook inbox, its signatures and its desk.
"""
