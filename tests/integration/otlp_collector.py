"""An in-process OTLP/HTTP trace collector for tests: a Starlette app accepting
``POST /v1/traces`` (protobuf, as the OpenTelemetry OTLP/HTTP exporter sends) and keeping every
span, decoded with ``opentelemetry-proto``. Serve it with ``tests.servers.serve_asgi``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    #: The W3C ``tracestate`` the span carried (empty: none).
    trace_state: str = ""


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Collector:
    """Receives ``POST /v1/traces`` (protobuf) and keeps every span."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.app = Starlette(routes=[Route("/v1/traces", self.traces, methods=["POST"])])

    async def traces(self, request: Request) -> Response:
        export = ExportTraceServiceRequest.FromString(await request.body())
        for rs in export.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(Span(
                        str(res.get("service.name")), s.name, s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                        s.trace_state))
        return Response(ExportTraceServiceResponse().SerializeToString(),
                        media_type="application/x-protobuf")

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]
