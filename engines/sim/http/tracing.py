"""The simulator's OpenTelemetry span, as vLLM's ``--otlp-traces-endpoint`` emits one.

vLLM (``vllm/tracing``) reads the W3C ``traceparent``/``tracestate`` request headers and, when
started with ``--otlp-traces-endpoint``, exports one SERVER span ``llm_request`` per request
with that context as parent. The simulator does the same when its config sets
``otlp_traces_endpoint``: one ``llm_request`` span per inference request, child of the incoming
``traceparent`` (a new trace without one), attributes ``gen_ai.request.id``,
``gen_ai.response.model`` and ``kvgate.sim.engine``. It covers the request from arrival to the
answer (a stream: to its first byte, when the response starts). Export: OTLP/HTTP protobuf,
batched (middleware/observe/tracing.py's provider, ``service.name`` = the engine id). Needs the
``tracing`` extra; unset: no OpenTelemetry import and no cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate.middleware.observe.tracing import NULL_SPAN, build_provider


class SimTracer:
    """One engine's tracer (``None`` endpoint: off, :meth:`span` returns NULL_SPAN)."""

    def __init__(self, endpoint: str | None, engine_id: str) -> None:
        self.engine_id = engine_id
        self.provider: Any = None if endpoint is None else build_provider(endpoint, engine_id,
                                                                          1.0)
        self._tracer: Any = None if self.provider is None else self.provider.get_tracer(
            "kvgate.sim")

    def span(self, headers: Mapping[str, str], request_id: str, model: str | None) -> Any:
        """The request's ``llm_request`` span (a context manager), parent from ``headers``."""
        if self._tracer is None:
            return NULL_SPAN
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(headers)
        attrs = {"gen_ai.request.id": request_id, "kvgate.sim.engine": self.engine_id}
        if model is not None:
            attrs["gen_ai.response.model"] = model
        return self._tracer.start_as_current_span(
            "llm_request", context=parent, kind=trace.SpanKind.SERVER, attributes=attrs)

    def flush(self) -> None:
        """Export the spans queued so far (blocking)."""
        if self.provider is not None:
            self.provider.force_flush()

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
