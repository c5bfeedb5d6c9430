"""The bundled example workflow: seeded by `seed_demo`, and the API schema's example."""

DEMO_WORKFLOW = {
    "name": "refund_review",
    "description": (
        "Triage and billing look at the request side by side (read-only), their findings are joined "
        "into one brief, and the support agent answers the customer with it."
    ),
    "graph": {
        "steps": {
            "triage": {"agent": "triage"},
            "billing": {"agent": "billing"},
            "findings": {"join": True},
            "brief": {"function": "combine_findings"},
            "support": {"agent": "support", "retry": {"max_attempts": 2, "initial_delay": 2}},
        },
        "chains": [["START", ["triage", "billing"], "findings", "brief", "support"]],
    },
}
