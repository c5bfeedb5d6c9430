"""ADK's API server wire under /adk/ (docs/architecture.md, "ADK's own wires").

A thin door: a session is ADK's own (the ledger's sessions already are ADK's tables), a `/run`
or `/run_sse` is a ledger run started by `runs.services.run.start_run` and executed like a chat turn,
and a function response that answers a waiting call is a decision taken by `runs.ledger.approvals`.
"""
