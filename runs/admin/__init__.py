"""The support desk: the run ledger, the webhook inbox, user schedules, owner grants and memories in the Django admin.

Each module registers its own ModelAdmins; actions are doors onto the services and report
refusals through `config.lib.admin.act_on_each`.
"""

from runs.admin import effects, inbox, memory, owners, runs, schedules, tokens  # noqa: F401 - each registers its ModelAdmins
