"""Tests of agents: loading, trust, the diet, retries, workflows, ADK's session store, the model's wire.
"""
