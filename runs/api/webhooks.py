"""`POST /api/webhooks/{source}/`: the durable inbox's only door for providers.

No user authentication: the HMAC-SHA256 signature with the source's shared secret is the
authentication (runs.inbox.signing: a time, the message id and the body, or the body alone). The body is read with a bound, never through `request.body` (whose limit
is DATA_UPLOAD_MAX_MEMORY_SIZE, not WEBHOOK_MAX_BYTES), and only after the declared length was
checked, so an oversized delivery is refused without reading it where the server allows.
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from config.lib.api_errors import ErrorSerializer
from runs.inbox import receipt, refusals
from runs.models.inbox import EventStatus


class WebhookReceiptSerializer(serializers.Serializer):
    event_id = serializers.UUIDField(help_text="The stored event (the first one, for a repeated delivery).")
    status = serializers.ChoiceField(choices=EventStatus.choices, help_text="The event's status now.")
    duplicate = serializers.BooleanField(help_text="True when this message id had already been received.")


def _declared_length(meta) -> int | None:
    try:
        return int(meta["CONTENT_LENGTH"])
    except (KeyError, TypeError, ValueError):
        return None


class WebhookReceiveView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="webhooks_receive",
        summary="Deliver an event to the durable inbox",
        description=(
            "Sign each delivery with the source's shared secret (HMAC-SHA256, hex). Timestamped scheme (the "
            "default): `X-Signature: t=<unix seconds>,v1=<hex>` over `<t>.<message id>.` followed by the raw "
            "body, within WEBHOOK_SIGNATURE_TOLERANCE_SECONDS of the server's clock (several `v1=` allowed "
            "while rotating secrets). Body scheme (sources whose message id is a body field): "
            "`X-Signature: sha256=<hex>` over the raw body. The event (and its attachments, as `attachments: [{filename, content_type, content_base64}]` "
            "for sources that take them) is stored before the answer. The provider's message id (a header "
            "or a JSON field, per source) makes delivery idempotent: the same id again answers 200 with "
            "the first event. Every delivery that is not authenticated (no enabled source of that name, a "
            "missing, malformed or wrong signature, or a signed message id that cannot be read) gets the same "
            "404 `not_accepted`, which says nothing of the source or its scheme; the reason is in the server's log."
        ),
        parameters=[
            OpenApiParameter(
                "X-Signature", str, OpenApiParameter.HEADER, required=True,
                description="t=<unix seconds>,v1=<hex> (timestamped scheme) or sha256=<hex> (body scheme)",
            ),
        ],
        request={"application/json": OpenApiTypes.OBJECT},
        responses={
            202: OpenApiResponse(WebhookReceiptSerializer, description="Stored; it will be processed."),
            200: OpenApiResponse(WebhookReceiptSerializer, description="Already received: the first event."),
            400: OpenApiResponse(
                ErrorSerializer, description="Signed, but not a JSON object, no message id, bad attachments."
            ),
            401: OpenApiResponse(ErrorSerializer, description="Signed correctly, but the timestamp is out of the window."),
            404: OpenApiResponse(
                ErrorSerializer, description="Not accepted: no such enabled source, or not signed as it expects."
            ),
            413: OpenApiResponse(ErrorSerializer, description="Larger than WEBHOOK_MAX_BYTES (or an attachment too large)."),
        },
        auth=[],
    )
    def post(self, request, source: str):
        django_request = request._request
        limit = settings.WEBHOOK_MAX_BYTES
        declared = _declared_length(django_request.META)
        if declared is not None and declared > limit:
            raise refusals.BodyTooLarge()
        body = django_request.read(limit + 1)
        delivered = receipt.receive_event(slug=source, body=body, headers=django_request.headers)
        event = delivered.event
        return Response(
            {"event_id": str(event.event_id), "status": event.status, "duplicate": not delivered.created},
            status=status.HTTP_202_ACCEPTED if delivered.created else status.HTTP_200_OK,
        )
