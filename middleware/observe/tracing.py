"""OpenTelemetry tracing of API requests (off unless the config has a ``tracing`` section).

Spans (all in one trace per request):

* ``kvgate.request`` (SERVER): the whole request; attributes ``kvgate.request_id``,
  ``kvgate.api``, ``gen_ai.request.model``, ``kvgate.tenant``, ``http.response.status_code``.
  Its parent is the client's W3C ``traceparent`` (and ``tracestate``) when it sent one.
* ``kvgate.auth``: the authenticator's verdict.
* ``kvgate.route``: one scheduling decision: ``kvgate.engine`` (target), ``kvgate.prefill``,
  ``kvgate.profiles``, ``kvgate.alternates`` (the next engines by rank, at most
  :data:`MAX_ALTERNATES`), ``kvgate.scores.PROFILE`` (each profile's best weighted totals as
  ``engine=score``, at most ``TOP_SCORES`` = 3; the scheduler keeps them only when tracing is
  on). A retried request has one per attempt.
* ``kvgate.upstream`` (CLIENT): one engine hop: ``kvgate.engine``, ``kvgate.role`` (``both``,
  ``prefill``, ``decode``), ``http.response.status_code``, ``kvgate.ttft_s``. A fresh
  ``traceparent`` naming this span is sent to the engine, so an engine that traces (vLLM with
  ``--otlp-traces-endpoint``, the simulator with ``otlp_traces_endpoint``) puts its span under it.
* ``kvgate.usage``: the usage hooks (billing's ledger write, quotas' settlement).

Off (no ``tracing`` section): no OpenTelemetry import, no span objects; every method returns
the shared :data:`NULL_SPAN` or does nothing. The client's own ``traceparent``/``tracestate``
are still passed to the engines unchanged (two dict look-ups per hop), so an engine that traces
joins the client's trace with the gateway invisible in it.

Export: OTLP/HTTP protobuf to ``otlp_endpoint`` + ``/v1/traces`` (or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` environment when the
section names no endpoint), batched by the SDK's ``BatchSpanProcessor`` on its own thread
(its queue is bounded: 2,048 spans, the newest dropped past it, the SDK's default). Sampling:
parent-based, new traces kept with probability ``sample_ratio``.

The packages are the ``tracing`` extra (``pip install kvgate[tracing]``); a config asking for
tracing without them is a ConfigError at startup.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from kvgate.middleware.framework.composition.config import TracingConfig
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.scheduler import ROUTE_SCORES
from kvgate.middleware.framework.types import CycleState, RoutingDecision

#: Alternates named on a route span: enough to see the runner-up, bounded for big pools.
MAX_ALTERNATES = 3
#: W3C trace-context headers (https://www.w3.org/TR/trace-context/).
TRACE_HEADERS = ("traceparent", "tracestate")
#: The standard variables the exporter reads when the config names no endpoint.
_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class NullSpan:
    """The span of tracing off: a context manager and attribute sink doing nothing."""

    __slots__ = ()

    def __enter__(self) -> NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: object) -> None:
        return None

    def is_recording(self) -> bool:
        return False


NULL_SPAN = NullSpan()


class Tracing:
    """The gateway's tracer; :meth:`off` (the default) costs nothing per request."""

    def __init__(self, tracer: Any = None, provider: Any = None) -> None:
        self._tracer = tracer
        self._provider = provider
        self.enabled = tracer is not None

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def from_config(cls, config: TracingConfig | None) -> Tracing:
        """Off for ``None``; else an OTLP exporting tracer (ConfigError: packages missing)."""
        if config is None:
            return cls.off()
        if config.otlp_endpoint is None and not any(
                os.environ.get(name) for name in _ENDPOINT_ENV):
            raise ConfigError("tracing: no otlp_endpoint and no OTEL_EXPORTER_OTLP_ENDPOINT "
                              "in the environment")
        provider = build_provider(config.otlp_endpoint, config.service_name,
                                  config.sample_ratio)
        return cls(provider.get_tracer("kvgate"), provider)

    # -- spans ----------------------------------------------------------------------------
    def start_request(self, headers: Mapping[str, str], api: str) -> Any:
        """Open the request's server span as the current span (its parent: the client's
        ``traceparent``); None when off. Close it with :meth:`end_request`."""
        if self._tracer is None:
            return None
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(headers)
        span = self._tracer.start_span("kvgate.request", context=parent,
                                       kind=trace.SpanKind.SERVER,
                                       attributes={"kvgate.api": api})
        token = context.attach(trace.set_span_in_context(span, parent))
        return span, token

    def end_request(self, handle: Any, attributes: Mapping[str, Any]) -> None:
        """Close what :meth:`start_request` opened (``attributes``: None values left out)."""
        if handle is None:
            return
        from opentelemetry import context, trace

        span, token = handle
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)
        status = attributes.get("http.response.status_code")
        if isinstance(status, int) and status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        context.detach(token)
        span.end()

    def span(self, name: str, attributes: Mapping[str, Any] | None = None,
             client: bool = False) -> Any:
        """A child of the current span, as a context manager (NULL_SPAN when off)."""
        if self._tracer is None:
            return NULL_SPAN
        from opentelemetry import trace

        kind = trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
        return self._tracer.start_as_current_span(name, kind=kind, attributes=attributes)

    def inject(self, headers: MutableMapping[str, str], client: Mapping[str, str]) -> None:
        """The trace-context headers of an engine request: the current span's when on, else
        the client's own (passed through unchanged)."""
        if self._tracer is None:
            for name in TRACE_HEADERS:
                value = client.get(name)
                if value is not None:
                    headers[name] = value
            return
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        TraceContextTextMapPropagator().inject(headers)

    def flush(self) -> None:
        """Export the spans queued so far (blocking: call it off the event loop)."""
        if self._provider is not None:
            self._provider.force_flush()

    def shutdown(self) -> None:
        """Export what is queued and stop (blocking: call it off the event loop)."""
        if self._provider is not None:
            self._provider.shutdown()


def routed(span: Any, decision: RoutingDecision, state: CycleState) -> None:
    """A route span's attributes from the scheduler's decision and each profile's top scores
    (``kvgate.scores.PROFILE``: ``engine=score`` strings, best first; bounded)."""
    if not span.is_recording():
        return
    for profile, best in (state.get(ROUTE_SCORES) or {}).items():
        span.set_attribute(f"kvgate.scores.{profile}",
                           [f"{engine}={score:.4f}" for engine, score in best])
    span.set_attribute("kvgate.engine", decision.target.id)
    if decision.prefill is not None:
        span.set_attribute("kvgate.prefill", decision.prefill.id)
    span.set_attribute("kvgate.profiles", list(decision.profiles)[:8])
    span.set_attribute("kvgate.alternates",
                       [ep.id for ep in decision.alternates[:MAX_ALTERNATES]])


def hop_done(span: Any, status: int, first_byte_at: float | None, started: float) -> None:
    """An upstream span's outcome: the engine's status and its time to first byte (s)."""
    if not span.is_recording():
        return
    span.set_attribute("http.response.status_code", status)
    if first_byte_at is not None:
        span.set_attribute("kvgate.ttft_s", round(first_byte_at - started, 6))


def build_provider(endpoint: str | None, service_name: str, sample_ratio: float) -> Any:
    """An SDK TracerProvider exporting OTLP/HTTP protobuf to ``endpoint`` (its
    ``/v1/traces``; None: the OTEL_EXPORTER_OTLP_* environment). Also used by the simulator."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ConfigError(f"tracing needs the OpenTelemetry packages: pip install "
                          f"'kvgate[tracing]' ({exc.name} is missing)") from None
    url = None if endpoint is None else endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return provider


__all__ = ["MAX_ALTERNATES", "NULL_SPAN", "TRACE_HEADERS", "NullSpan", "Tracing",
           "build_provider", "hop_done", "routed"]
