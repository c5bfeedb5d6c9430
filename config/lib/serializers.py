"""Strict reading for every API door: wrong types and unknown fields are refused, not guessed at."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension, OpenApiSerializerFieldExtension
from rest_framework import serializers

# Form fields that are part of a browser's form post rather than the request's data.
IGNORED_FORM_FIELDS = {"csrfmiddlewaretoken"}

# The schema's format for a name the API strips and then requires, refusing any character of
# Unicode's category C (controls, formatting, private use, unassigned): not blank, printable. No
# pattern can say "category C" (it depends on the Unicode version), so it is a format of its own.
PRINTABLE = "printable"
# A person's words shown to other people (config.lib.text): not blank, no control character but
# line breaks and tabs, no invisible formatting character (bidi overrides, zero-width marks). A
# format of its own for the same reason as PRINTABLE.
PLAIN_WORDS = "plain-words"
# What str.strip() removes, spelled out: JSON Schema reads patterns as ECMA-262, whose \s is not
# Python's (U+FEFF is a space there; U+001C-U+001F and U+0085 are not), so no pattern says \s.
_SPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# A message: any text without NUL, not blank.
NOT_BLANK_TEXT = rf"^[^\x00]*[^{_SPACE}\x00][^\x00]*$"
# A person's required words (config.lib.refusals.required_text): not blank once stripped.
SOME_WORD = rf"[^{_SPACE}]"

# A schema fragment, or a function giving one when the schema is generated (e.g. the names of
# the agents loaded now).
SchemaExtra = dict[str, Any] | Callable[[], dict[str, Any]]


def _extra(extra: SchemaExtra | None) -> dict[str, Any]:
    if extra is None:
        return {}
    return extra() if callable(extra) else dict(extra)


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know, instead of silently dropping them."""

    # Its schema says so (additionalProperties: false); schema_extra adds what no single field can
    # say, e.g. a oneOf for fields that exclude each other.
    schema_extra: SchemaExtra | None = None

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

    # `schema` states what the service behind the field refuses (a pattern, an enum, a length)
    # where the field leaves the checking, and its wording, to the service.

    default_error_messages = {"invalid": "Must be a string."}

    def __init__(self, *, schema: SchemaExtra | None = None, **kwargs):
        self.schema_extra = schema
        super().__init__(**kwargs)

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


class StrictSerializerSchema(OpenApiSerializerExtension):
    target_class = StrictSerializer
    match_subclasses = True

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_basic_serializer(self.target, direction)
        for name, field in self.target.fields.items():
            prop = schema.get("properties", {}).get(name, {})
            if isinstance(field, StrictCharField) and field.schema_extra and field.allow_blank and "oneOf" in prop:
                # allow_blank adds "or an empty string"; the service behind the field refuses it.
                prop.update(prop.pop("oneOf")[0])
        schema["additionalProperties"] = False
        schema.update(_extra(self.target.schema_extra))
        return schema


class StrictCharFieldSchema(OpenApiSerializerFieldExtension):
    target_class = StrictCharField
    match_subclasses = True

    def map_serializer_field(self, auto_schema, direction):
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        schema.update(_extra(self.target.schema_extra))
        return schema
