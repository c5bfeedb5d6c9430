"""Strict reading for every API door: wrong types and unknown fields are refused, not guessed at."""

from __future__ import annotations

from rest_framework import serializers

# Form fields that are part of a browser's form post rather than the request's data.
IGNORED_FORM_FIELDS = {"csrfmiddlewaretoken"}


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know, instead of silently dropping them."""

    def to_internal_value(self, data):
        if hasattr(data, "keys"):
            unknown = sorted(set(data.keys()) - set(self.fields) - IGNORED_FORM_FIELDS)
            if unknown:
                known = ", ".join(name for name, field in self.fields.items() if not field.read_only)
                raise serializers.ValidationError(
                    {name: [f"Unknown field. The fields are: {known}."] for name in unknown}
                )
        return super().to_internal_value(data)


class StrictCharField(serializers.CharField):
    """A string, not a number or a list turned into one."""

    default_error_messages = {"invalid": "Must be a string."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """true or false (the strings "true"/"false" in a form); never "yes", 1 or "maybe"."""

    default_error_messages = {"invalid": "Must be true or false."}

    def to_internal_value(self, data):
        if isinstance(data, bool):
            return data
        if isinstance(data, str) and data.lower() in {"true", "false"}:
            return data.lower() == "true"
        self.fail("invalid")


class EmptySerializer(StrictSerializer):
    """No fields: the request body is empty or {}."""
