"""Tests of config and the project's kit: limits, hostile input, settings, errors, the docs' truth.
"""
