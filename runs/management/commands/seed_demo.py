from django.core.management.base import BaseCommand

from agents.demo import DEMO_WORKFLOW
from agents.models import Customer, WorkflowDefinition
from agents.services import save_workflow
from runs.execution import executor
from runs.management.commands.run_agent import describe
from runs.models.ledger import AgentRun
from runs.services import run as services

DEMO_CUSTOMERS = [
    {"email": "jane@example.com", "name": "Jane Doe", "contact_id": "C-1001", "plan": "pro"},
    {"email": "omar@example.com", "name": "Omar Haddad", "contact_id": "C-1002", "plan": "free"},
]

REFUND_EMAIL = {
    "to": "omar@example.com",
    "subject": "About your invoice",
    "body": "Hello Omar, we have corrected your invoice; the new one is attached to your account.",
}

DEMO_RUNS = [
    ("Jane asks where her refund is.", "alice", None),
    (
        "Omar cannot log in.",
        "bob",
        # Transient, as such outages are: a replay (or resume) of it goes on past this step.
        [{"fail": "error", "message": "The model service is unavailable (503).", "once": True},
         {"say": "I have sent Omar a link to reset his password."}],
    ),
    (
        "Omar's invoice is wrong.",
        "bob",
        [
            {"call": "lookup_customer", "args": {"email": "omar@example.com"}},
            {"call": "send_email", "args": REFUND_EMAIL},
            {"fail": "error", "message": "The model service stopped answering mid-run.", "once": True},
            {"say": "I corrected Omar's invoice and emailed him about it."},
        ],
    ),
    # Above the approval threshold: the run waits on the desk for a person's approval.
    (
        "Jane was charged twice for order A-1001.",
        "alice",
        [
            {"call": "lookup_customer", "args": {"email": "jane@example.com"}},
            {"call": "issue_refund", "args": {"order_id": "A-1001", "amount_cents": 25_000}},
            {"say": "I refunded 250.00 for order A-1001.",
             "if_rejected": "The refund of 250.00 for order A-1001 was rejected, so no refund was made."},
        ],
    ),
]


def ensure_demo_workflow() -> tuple[WorkflowDefinition, bool]:
    """The demo workflow, created once; a staff member's later edits are kept."""
    existing = WorkflowDefinition.objects.filter(name=DEMO_WORKFLOW["name"]).first()
    if existing is not None:
        return existing, False
    return save_workflow(**DEMO_WORKFLOW), True


class Command(BaseCommand):
    help = (
        "Seed the demo by really running the scripted support agent: one run that succeeds, one "
        "that fails before any tool, one that fails after send_email, one that waits for a person to "
        "approve a refund, and one run of the demo "
        "workflow (created if missing). Runs are seeded only into an empty ledger."
    )

    def handle(self, *args, **options):
        for customer in DEMO_CUSTOMERS:
            Customer.objects.get_or_create(email=customer["email"], defaults=customer)
        workflow, created = ensure_demo_workflow()
        if created:
            self.stdout.write(f"Demo workflow {workflow.name!r} created.")
        if AgentRun.objects.exists():
            self.stdout.write("The ledger already holds runs; the demo is not seeded again.")
            return
        for message, owner, script in DEMO_RUNS:
            run = services.start_run(
                agent_name="support",
                message=message,
                owner_id=owner,
                params={"script": script} if script else {},
                enqueue=False,
            )
            executor.execute(run.run_id)
            run.refresh_from_db()
            summary = describe(run).replace("\n", "; ")
            self.stdout.write(f"Demo run {run.run_id}: {summary}")
        run = services.start_run(
            agent_name=workflow.name, message="Jane asks where her refund is.", owner_id="alice", enqueue=False
        )
        executor.execute(run.run_id)
        run.refresh_from_db()
        self.stdout.write(f"Demo workflow run {run.run_id}: {describe(run).replace(chr(10), '; ')}")
