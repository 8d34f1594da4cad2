"""Schemathesis over the management app's own /openapi.json (asyncq/batch/mgmt.py): every operation
called with generated inputs -- a bounded, derandomised number of examples -- must never
answer 5xx, and every error must be in OpenAI's shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings

from kvgate.asyncq.batch.mgmt import ManagementSettings, build_management_app, plane_of
from tests.integration.batch_helpers import MemoryQueue

AUTH = {"authorization": "Bearer sk-fuzz"}
#: Examples per operation (11 operations): enough to hit every parameter's edge cases.
EXAMPLES = 25


def check(case: Any) -> None:
    response = case.call(headers=AUTH)
    assert response.status_code < 500, (case.method, case.path, response.text)
    if response.status_code >= 400:
        err = json.loads(response.content)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)


def test_no_5xx_and_openai_shaped_errors(tmp_path: Path) -> None:
    app = build_management_app(MemoryQueue(), ManagementSettings(
        data_dir=str(tmp_path), finalize_interval_s=3600.0))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) == 11
    try:
        for operation in operations:
            run = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                           database=None, suppress_health_check=list(HealthCheck))(
                given(case=operation.as_strategy())(check))
            run()
    finally:
        plane_of(app).db.close()
