"""The ledger's event counters (Prometheus), kept per process; `runs.upkeep.metrics` says how they add up.

A module of its own, with no imports from the ledger, so the code that counts (reconcile,
services, the executor) can import it without importing the metrics' readers.
"""

import prometheus_client

RECONCILIATIONS = prometheus_client.Counter(
    "agentledger_reconciliations", "Runs this process reconciled (their worker had gone silent)."
)
REPLAY_REFUSALS = prometheus_client.Counter(
    "agentledger_replay_refusals", "Replay requests the rules refused, by refusal code.", ["code"]
)
MODEL_RETRIES = prometheus_client.Counter(
    "agentledger_model_retries", "Model calls re-sent at the model-call boundary, by reason.", ["reason"]
)
LEASE_REFUSALS = prometheus_client.Counter(
    "agentledger_lease_refusals",
    "Writes refused because the run was no longer held by the worker's lease (the run was aborted there), "
    "by kind of write.",
    ["write"],
)
RECOVERIES = prometheus_client.Counter(
    "agentledger_recoveries", "Runs that died and that this process continued as a resume, without a person."
)
RUNS_CLAIMED = prometheus_client.Counter(
    "agentledger_runs_claimed", "Runs claimed from the ledger by worker processes (their rate is the claim rate).",
)
