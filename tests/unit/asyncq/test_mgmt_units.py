"""Pure pieces of the management plane: line counting across chunk boundaries (uploads are
copied in chunks), the output/error line shapes of every job outcome, webhook secrets."""

from __future__ import annotations

import io
import random
from pathlib import Path

import orjson
import pytest

from kvgate.asyncq.api import Job, JobResult, JobSpec, JobState
from kvgate.asyncq.batch import files
from kvgate.asyncq.batch.lines import job_row
from kvgate.asyncq.webhooks import secret_key, sign
from kvgate.middleware.framework.errors import BadRequest, PayloadTooLarge


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
@pytest.mark.parametrize(("data", "lines"), [
    (b"", 0), (b"\n\n", 0), (b"a", 1), (b"a\n", 1), (b"a\nb", 2), (b"a\n\n  \nb\n", 2),
    (b"  \na", 1), (b"abc\ndef\r\nghi", 3),
])
def test_copy_counts_non_blank_lines_across_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, data: bytes,
        lines: int) -> None:
    monkeypatch.setattr(files, "CHUNK", chunk)
    dest = tmp_path / "f"
    assert files._copy(io.BytesIO(data), dest, 1000, 1000) == (len(data), lines)
    assert dest.read_bytes() == data
    assert files.count_lines(dest) == lines


def test_copy_refuses_past_the_limits(tmp_path: Path) -> None:
    rng = random.Random(5)
    data = b"".join(b"x" * rng.randint(1, 9) + b"\n" for _ in range(50))
    with pytest.raises(PayloadTooLarge):
        files._copy(io.BytesIO(data), tmp_path / "a", len(data) - 1, 1000)
    with pytest.raises(BadRequest):
        files._copy(io.BytesIO(data), tmp_path / "b", len(data), 49)
    assert files._copy(io.BytesIO(data), tmp_path / "c", len(data), 50) == (len(data), 50)


def _job(state: JobState, result: JobResult | None) -> Job:
    spec = JobSpec(id="batch_req_1", kind="batch", method="POST", path="/v1/embeddings",
                   body=b"{}", tenant=None, key_id=None, created_at=0.0, deadline=None,
                   batch_id="batch_1", custom_id="c1")
    return Job(spec, state, 1, result, None, None)


OK = JobResult(200, b'{"object": "list"}', "application/json", "e", 1.0)
ERR = JobResult(400, b'{"error": {"message": "m"}}', "application/json", "e", 1.0)
KVGATE_EXPIRED = JobResult(408, b'{"error": {"code": "expired"}}', "application/json", None, 1.0)


@pytest.mark.parametrize(("state", "result", "ok", "status", "error"), [
    (JobState.SUCCEEDED, OK, True, 200, None),
    (JobState.FAILED, ERR, False, 400, None),
    (JobState.SUCCEEDED, ERR, False, 400, None),
    (JobState.EXPIRED, None, False, None, "batch_expired"),
    (JobState.EXPIRED, KVGATE_EXPIRED, False, None, "batch_expired"),
    (JobState.CANCELLED, None, False, None, "batch_cancelled"),
    (JobState.FAILED, None, False, None, "request_failed"),
])
def test_job_rows(state: JobState, result: JobResult | None, ok: bool, status: int | None,
                  error: str | None) -> None:
    to_output, raw = job_row(_job(state, result))
    row = orjson.loads(raw)
    assert to_output is ok
    assert (row["id"], row["custom_id"]) == ("batch_req_1", "c1")
    if status is None:
        assert row["response"] is None and row["error"]["code"] == error
    else:
        assert row["error"] is None
        assert row["response"]["status_code"] == status
        assert row["response"]["request_id"] == "batch_req_1"
        assert isinstance(row["response"]["body"], dict)


@pytest.mark.parametrize("secret", ["abc", "whsec_not base64!", "whsec_c2hvcnQ="])
def test_bad_secrets_are_refused(secret: str) -> None:
    with pytest.raises(ValueError):
        secret_key(secret)


def test_signature_changes_with_every_signed_part() -> None:
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    base = sign(secret, "msg_1", 100, b"{}")
    assert base.startswith("v1,")
    assert len({base, sign(secret, "msg_2", 100, b"{}"), sign(secret, "msg_1", 101, b"{}"),
                sign(secret, "msg_1", 100, b"{ }")}) == 4
