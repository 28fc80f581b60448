"""Envoy's ext_proc stream (envoy.service.ext_proc.v3), read as the Gateway API inference extension's endpoint-picker
protocol (its docs/proposals/004-endpoint-picker-protocol):

    gateway ─▶ request_headers      (the candidate subset, if any, in the metadata namespace envoy.lb.subset_hint,
                                     key x-gateway-destination-endpoint-subset: a list of HOST:PORT)
            ─▶ request_body         (buffered: the whole body, end_of_stream)
    EPP     ─▶ the pick             header x-gateway-destination-endpoint: HOST:PORT, the same in the dynamic metadata
                                     envoy.lb; for PD also x-prefiller-host-port (llm-d's name) naming the prefill
                                     (or an immediate 503 when no candidate is healthy)

A request without a body (end_of_stream on its headers) is picked at its headers; a body sent in parts is picked once
whole (the FULL_DUPLEX_STREAMED mode, which must echo each part, is not spoken). A body that is not a JSON object is
placed by load alone. Response phases, if the gateway sends them, are answered unchanged. The gateway's own copy of
either header (a client's) is overwritten or removed, so a client cannot choose its endpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorServicer
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from common.wire.errors import error_body
from router.epp.picker import NoEndpoint, Pick, Picker

log = logging.getLogger("tandem.epp")
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
LB_NAMESPACE = "envoy.lb"
PREFILLER = "x-prefiller-host-port"
OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
PASS = {  # a phase this server does not act on, answered unchanged
    "response_headers": lambda: pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": lambda: pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": lambda: pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": lambda: pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def subset_of(metadata: Metadata) -> list[str] | None:
    """The gateway's candidate endpoints (HOST:PORT), None when it gave none."""
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


def picked(pick: Pick, phase: str) -> pb.ProcessingResponse:
    """The answer naming `pick`, for the phase (request_headers | request_body) it answers."""
    headers = [
        HeaderValueOption(
            header=HeaderValue(key=DESTINATION, raw_value=pick.endpoint.encode()), append_action=OVERWRITE
        )
    ]
    removed = []
    if pick.prefill is not None:
        headers.append(
            HeaderValueOption(
                header=HeaderValue(key=PREFILLER, raw_value=pick.prefill.encode()), append_action=OVERWRITE
            )
        )
    else:
        removed.append(PREFILLER)
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=headers, remove_headers=removed), clear_route_cache=True
    )
    metadata = Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: pick.endpoint}})
    answer = pb.ProcessingResponse(dynamic_metadata=metadata)
    getattr(answer, phase).response.CopyFrom(common)
    return answer


def refused(e: NoEndpoint) -> pb.ProcessingResponse:
    body = json.dumps(error_body(str(e), "overloaded_error", e.status)).encode()
    headers = pb.HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key="content-type", raw_value=b"application/json")),
            HeaderValueOption(header=HeaderValue(key="retry-after", raw_value=b"1")),
        ]
    )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(status=HttpStatus(code=e.status), headers=headers, body=body)
    )


class ExtProc(ExternalProcessorServicer):
    """One `Process` stream per request the gateway forwards."""

    def __init__(self, picker: Picker):
        self.picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context
    ) -> AsyncIterator[pb.ProcessingResponse]:  # noqa: N802 (gRPC's name)
        """The stream lives as long as the request (Envoy closes it when the request ends): the pick's workers
        count it in flight until then."""
        subset: list[str] | None = None
        body, picks = b"", []
        try:
            async for request in request_iterator:
                phase = request.WhichOneof("request")
                if phase == "request_headers":
                    subset = subset_of(request.metadata_context)
                    if request.request_headers.end_of_stream:
                        yield self._answer(b"", subset, phase, picks)
                    else:
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif phase == "request_body":
                    body += request.request_body.body
                    if request.request_body.end_of_stream:
                        yield self._answer(body, subset, phase, picks)
                    else:  # a body sent in parts: the pick waits for the whole
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                elif phase in PASS:
                    yield PASS[phase]()
        finally:
            for pick in picks:
                self.picker.release(pick)

    def _answer(self, raw: bytes, subset: list[str] | None, phase: str, picks: list[Pick]) -> pb.ProcessingResponse:
        try:
            pick = self.picker.pick(parse_body(raw), subset)
        except NoEndpoint as e:
            log.warning("no endpoint: %s", e)
            return refused(e)
        picks.append(pick)
        log.debug("picked %s (prefill %s)", pick.endpoint, pick.prefill)
        return picked(pick, phase)
