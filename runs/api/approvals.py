"""`…/calls/{call_id}/decision/` and `…/calls/{call_id}/result/`: thin doors onto runs.ledger.approvals."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.response import Response

from config.lib.api_errors import errors
from runs.api.serializers import AnsweredCallSerializer, CallResultSerializer, DecisionSerializer
from runs.services import decisions


class CallAnswerActions:
    """Mixed into the runs viewset: a person's decision on a call that waits, a long-running call's result.

    A call id is whatever the model or tool gave ADK, `/` included (sent as `%2F`, decoded before
    routing): the route takes it whole."""

    def _answered(self, pending) -> Response:
        pending.run.refresh_from_db(fields=["status"])
        return Response(AnsweredCallSerializer(pending, context=self.get_serializer_context()).data,
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        summary="Approve or reject a tool call that waits for a person",
        description=(
            "A `waiting` run asked for a confirmation before this call (ADK's `require_confirmation`, or the tool's "
            "`request_confirmation`). `approve` runs the call, with the arguments it was asked with and under every "
            "rule (journal first, effect records); `reject` tells the model it was rejected. The decision is taken "
            "once: a second answers 409 `already_decided`. When the run waits for nothing more it goes on as the "
            "same run (status `queued`, then claimed again). Needs runs.approve_toolcall (else 403 "
            "`approve_not_permitted`); 404 for a run you cannot see or a call it does not wait for; 409 "
            "`wrong_answer_kind` for a long-running call (send its result instead)."
        ),
        request={"application/json": DecisionSerializer},
        responses={202: AnsweredCallSerializer, **errors(400, 401, 403, 404, 409, 413, 415)},
        examples=[OpenApiExample("Approve", value={"decision": "approve", "note": "Order checked: refund is due."},
                                 request_only=True)],
    )
    @action(detail=True, methods=["post"], url_path=r"calls/(?P<call_id>.+)/decision", url_name="call-decision")
    def decision(self, request, run_id=None, call_id=None):
        serializer = DecisionSerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        pending = decisions.decide_call(
            run_id=run_id, call_id=call_id, actor=request.user, decision=data["decision"],
            note=data.get("note", ""), payload=data.get("payload"),
        )
        return self._answered(pending)

    @extend_schema(
        summary="Give a long-running tool call its result",
        description=(
            "A `waiting` run called a long-running tool (ADK's `LongRunningFunctionTool`) that did not answer at "
            "once. The `result` becomes the call's function response and the run goes on as the same run. Taken "
            "once (409 `already_decided` for a second). Needs runs.answer_toolcall (else 403 "
            "`answer_not_permitted`) and the right to act for the run's owner (403 `owner_not_permitted`); 409 "
            "`wrong_answer_kind` for a call that waits for a person's approval."
        ),
        request={"application/json": CallResultSerializer},
        responses={202: AnsweredCallSerializer, **errors(400, 401, 403, 404, 409, 413, 415)},
        examples=[OpenApiExample("Label", value={"result": {"label_url": "https://carrier.example/label/123"}},
                                 request_only=True)],
    )
    @action(detail=True, methods=["post"], url_path=r"calls/(?P<call_id>.+)/result", url_name="call-result")
    def result(self, request, run_id=None, call_id=None):
        serializer = CallResultSerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        pending = decisions.give_result(
            run_id=run_id, call_id=call_id, actor=request.user, result=data["result"], note=data.get("note", ""),
        )
        return self._answered(pending)
