"""The runs app's models, one module per product. Import a model from its module
(`from runs.models.ledger import AgentRun`): this package only imports them so Django registers
them, and re-exports nothing.

Tables and app label are those of the single module this package grew from, so splitting it
needed no migration.
"""

from runs.models import approvals, chat, effects, inbox, ledger, owners, schedules, tokens  # noqa: F401 - registers the models
