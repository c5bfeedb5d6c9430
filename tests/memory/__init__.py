"""Tests of memory.
"""
