"""Who may act for whom: an admin's grant that lets one user act for one owner."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from runs.inputs.run_input import clean_owner_id

# The same length as a run's owner_id (runs.inputs.run_input.MAX_OWNER_ID_CHARS): a grant names an owner
# exactly as runs store it.
OWNER_ID_MAX_LENGTH = 128


class OwnerGrant(models.Model):
    """`user` may start runs, chat turns and read memory for `owner_id` (docs/architecture.md, "Who may act for whom").

    Configuration, not a record: an admin adds and removes grants. A user needs none for their
    own username, nor when they hold `runs.act_for_any_owner`.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="owner_grants")
    owner_id = models.CharField(max_length=OWNER_ID_MAX_LENGTH, help_text="The end user they may act for.")
    granted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    note = models.CharField(max_length=500, blank=True, help_text="Why: e.g. the ticket or the team it is for.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "owner_grants"
        ordering = ["user", "owner_id"]
        constraints = [
            # Also the index the owner rule reads: (user, owner_id) exists?
            models.UniqueConstraint(fields=["user", "owner_id"], name="ownergrant_user_owner"),
        ]

    def __str__(self) -> str:
        return f"{self.user} may act for {self.owner_id}"

    def clean(self) -> None:
        self.owner_id = clean_owner_id(self.owner_id)
