"""Engine adapter extension point: how the core talks to one kind of engine.

Adapters live in ``engines/`` and are found through the ``kvgate.engines`` entry-point group
(``kind`` -> class). The core knows no engine by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvgate.middleware.framework.types import EngineMetrics, InferenceRequest, Usage


@runtime_checkable
class EngineAdapter(Protocol):
    """Health probing, metrics parsing, request shaping and usage extraction for one engine kind.

    All methods are pure (no I/O): the pool does the HTTP and hands the adapter the payloads.
    Body shaping and usage on the request path are the client API's (middleware/framework/api.py:
    ``ApiAdapter.prepare_body``, ``UsageTap``), since they depend on the API's shape;
    ``prepare_body`` / ``extract_usage`` here are the OpenAI-shaped helpers for tools.
    """

    kind: ClassVar[str]
    health_path: ClassVar[str]
    metrics_path: ClassVar[str | None]
    models_path: ClassVar[str | None]

    def parse_metrics(self, text: str, scraped_at: float) -> EngineMetrics:
        """Parse a Prometheus text exposition into :class:`EngineMetrics`."""
        ...

    def parse_models(self, payload: Mapping[str, Any]) -> frozenset[str]:
        """Model ids from the engine's ``GET /v1/models`` JSON."""
        ...

    def prepare_body(self, req: InferenceRequest, body: dict[str, Any]) -> dict[str, Any]:
        """Shape the body sent upstream (e.g. always ask streams for a usage chunk)."""
        ...

    def extract_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        """Usage from a response JSON or an SSE chunk; ``None`` when it carries none."""
        ...
