import json
import time
from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from runs.execution import executor
from runs.models.ledger import IN_FLIGHT, AgentRun, RunStatus
from runs.services import run as services

# --wait's exit status: 0 only when the run succeeded.
EXIT_FAILED = 2  # the run ended `error` or `cancelled`
EXIT_NOT_DONE = 3  # it waits for a person, or is still in flight when --timeout ran out


class Command(BaseCommand):
    help = (
        "Start a run of a registered agent or a workflow. The run is written down (with a copy of --file) "
        "before it is queued; --wait prints its outcome once a worker has settled it and exits 0 only if "
        f"it succeeded ({EXIT_FAILED}: error or cancelled; {EXIT_NOT_DONE}: waiting for a person, or still "
        "in flight at --timeout)."
    )

    def add_arguments(self, parser):
        parser.add_argument("agent", help="registered agent or workflow name, e.g. support or refund_review")
        parser.add_argument("message", help="what the agent should do")
        parser.add_argument("--owner", required=True, help="the end user the run acts for")
        parser.add_argument("--file", help="a file to attach; it is copied before the run starts")
        parser.add_argument("--script", help="JSON list of scripted-model steps (offline model only)")
        parser.add_argument(
            "--scripts", help='for a workflow: JSON object of scripts per agent name, e.g. {"triage": [...]}'
        )
        parser.add_argument("--wait", action="store_true", help="wait for the outcome and print it")
        parser.add_argument(
            "--inline",
            action="store_true",
            help="execute in this process instead of handing the run to the worker (implies --wait)",
        )
        parser.add_argument("--timeout", type=float, default=600, help="seconds --wait waits (default 600)")

    def handle(self, *args, **options):
        params = {}
        if options["script"] is not None:
            try:
                params["script"] = json.loads(options["script"])
            except json.JSONDecodeError as exc:
                raise CommandError(f"--script is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.") from None
        if options["scripts"] is not None:
            try:
                params["scripts"] = json.loads(options["scripts"])
            except json.JSONDecodeError as exc:
                raise CommandError(f"--scripts is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.") from None
        handle = None
        if options["file"]:
            path = Path(options["file"])
            if not path.is_file():
                raise CommandError(f"--file {path} does not exist or is not a file.")
            handle = path.open("rb")
        try:
            run = services.start_run(
                agent_name=options["agent"],
                message=options["message"],
                owner_id=options["owner"],
                params=params,
                file=handle,
                file_name=Path(options["file"]).name if options["file"] else None,
                enqueue=not options["inline"],
            )
        except ValidationError as exc:
            problems = "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in exc.message_dict.items())
            raise CommandError(f"The run was not started. {problems}") from None
        finally:
            if handle is not None:
                handle.close()
        self.stdout.write(str(run.run_id))
        # Inline, this process claims the run at once; a worker that got there first runs it, and
        # this waits for it as --wait does.
        if options["inline"] and executor.execute(run.run_id) != executor.NOT_CLAIMED:
            pass
        elif options["inline"] or options["wait"]:
            deadline = time.monotonic() + options["timeout"]
            while AgentRun.objects.filter(pk=run.run_id, status__in=IN_FLIGHT).exists():
                if time.monotonic() > deadline:
                    raise CommandError(
                        f"Run {run.run_id} is still in flight after {options['timeout']:g} s; is the worker running?",
                        returncode=EXIT_NOT_DONE,
                    )
                time.sleep(0.5)
        else:
            return
        run.refresh_from_db()
        self.stdout.write(describe(run))
        if run.status == RunStatus.WAITING:
            raise CommandError(f"Run {run.run_id} waits for a person (see the run page).", returncode=EXIT_NOT_DONE)
        if run.status != RunStatus.SUCCESS:
            raise CommandError(f"Run {run.run_id} did not succeed: {run.status}.", returncode=EXIT_FAILED)


def describe(run: AgentRun) -> str:
    tools = "unknown" if run.tools_executed is None else (", ".join(run.tools_executed) or "none")
    lines = [f"status: {run.status}", f"tools called: {tools}"]
    if run.error_code:
        lines.append(f"error: {run.error_code}: {run.error_message}")
    if run.result:
        lines.append(f"result: {run.result}")
    for call in run.pending_calls.filter(decision="").order_by("asked_at"):
        waits_for = "a person's approval" if call.kind == "confirmation" else "its result"
        lines.append(f"waiting: {call.tool_name} {call.call_id} {call.args} for {waits_for}")
    return "\n".join(lines)
