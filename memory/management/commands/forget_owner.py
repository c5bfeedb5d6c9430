from django.core.management.base import BaseCommand, CommandError

from agents.registry import UnknownAgentError, get_agent_spec
from memory import services
from memory.refusals import MemoryRefusal


class Command(BaseCommand):
    help = "Delete every long-term memory of one owner (the right to be forgotten), for all agents or one."

    def add_arguments(self, parser):
        parser.add_argument("owner_id", help="the end user whose memories go")
        parser.add_argument("--agent", help="only this agent's memories of the owner")

    def handle(self, *args, owner_id, agent=None, **options):
        if agent is not None:
            try:
                get_agent_spec(agent)
            except UnknownAgentError as exc:
                raise CommandError(str(exc)) from None
        try:
            deleted = services.forget_owner(owner_id=owner_id, agent=agent)
        except MemoryRefusal as refusal:
            raise CommandError(refusal.detail) from None
        scope = f" of agent {agent!r}" if agent else ""
        self.stdout.write(f"Forgot {deleted} memor{'y' if deleted == 1 else 'ies'}{scope} for owner {owner_id!r}.")
