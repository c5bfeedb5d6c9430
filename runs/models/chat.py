"""Chat conversations: their turns are runs that share one ADK session."""

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone


class Conversation(models.Model):
    """A chat: its turns are runs (trigger `chat`) that share one ADK session.

    It belongs to the user who started it, for one owner and one agent; nobody else can add a
    turn to it. Its row is also what two simultaneous turns lock to learn that one is running.
    """

    conversation_id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent_name = models.CharField(max_length=128)
    owner_id = models.CharField(max_length=128)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    session_id = models.CharField(max_length=128, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "conversations"
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["created_by", "created_at"], name="conversation_creator_created")]

    def __str__(self) -> str:
        return f"{self.agent_name} conversation {self.conversation_id}"
