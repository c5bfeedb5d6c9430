"""A2A per agent at `/a2a/{agent}`: the a2a-sdk's JSON-RPC dispatcher and card route (`app`,
mounted by `config/asgi.py`), the SDK's request handler answered from the ledger (`handler`) and a
run as an A2A task (`tasks`). A door: it calls `runs.services` and reads the ledger.
"""
