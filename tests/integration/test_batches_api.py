"""The management plane (asyncq/batch/mgmt.py) in-process: the real ``openai`` SDK over httpx's
ASGITransport against the FastAPI app, jobs run by a small in-memory queue
(tests/integration/batch_helpers.py). Shapes, validation, tenant scoping, cancel, expiry,
finalisation after a restart and by two racing processes, upload limits."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import orjson
import pytest
from fastapi import FastAPI

from kvgate.asyncq.api import JobResult, JobSpec
from kvgate.asyncq.batch.lines import job_id, validate_lines
from kvgate.asyncq.batch.mgmt import ManagementSettings, build_management_app, plane_of
from tests.integration.batch_helpers import MemoryQueue

CHAT: Final = "/v1/chat/completions"


def line(custom_id: str | None, *, url: str = CHAT, method: str = "POST",
         body: Any = None, prompt: str = "hi") -> dict[str, Any]:
    body = body if body is not None else {
        "model": "m", "max_tokens": 4,
        "messages": [{"role": "system", "content": "shared system prompt"},
                     {"role": "user", "content": prompt}]}
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def jsonl(rows: list[Any]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


async def echo(spec: JobSpec) -> JobResult:
    """What an engine would answer: a chat completion naming the request's last message."""
    body = json.loads(spec.body)
    if body.get("model") == "bad-model":
        err = {"error": {"message": "no such model", "type": "invalid_request_error",
                         "param": "model", "code": "model_not_found"}}
        return JobResult(404, orjson.dumps(err), "application/json", None, 0.0)
    answer = {"id": f"chatcmpl-{spec.custom_id}", "object": "chat.completion",
              "model": body["model"],
              "choices": [{"index": 0, "finish_reason": "stop", "message": {
                  "role": "assistant", "content": body["messages"][-1]["content"]}}],
              "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}
    return JobResult(200, orjson.dumps(answer), "application/json", "sim-0", 0.0)


@contextlib.asynccontextmanager
async def plane_app(tmp: Path, queue: MemoryQueue, **settings: Any) -> AsyncIterator[FastAPI]:
    cfg = ManagementSettings(data_dir=str(tmp), **{"finalize_interval_s": 0.2, **settings})
    app = build_management_app(queue, cfg)
    async with plane_of(app).running():
        yield app


def sdk(app: FastAPI, key: str = "sk-acme") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(api_key=key, base_url="http://mgmt/v1", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


async def wait_status(client: openai.AsyncOpenAI, batch_id: str, statuses: set[str],
                      limit_s: float = 10.0) -> Any:
    for _ in range(int(limit_s / 0.05)):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def content_lines(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(x) for x in raw.splitlines() if x.strip()]


async def test_batch_round_trip_with_the_openai_sdk(tmp_path: Path) -> None:
    queue = MemoryQueue()
    rows: list[Any] = [line(f"r{i}", prompt=f"question {i}") for i in range(6)]
    rows += [line("r0"), line("x1", url="/v1/completions"), "not an object"]
    async with plane_app(tmp_path, queue) as app:
        client = sdk(app)
        f = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        assert (f.object, f.purpose, f.bytes, f.filename) == (
            "file", "batch", len(jsonl(rows)), "in.jsonl")
        batch = await client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                            completion_window="24h",
                                            metadata={"run": "nightly"})
        assert batch.status == "in_progress"
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.failed) == (9, 3)
        assert batch.metadata == {"run": "nightly"}
        assert batch.expires_at == batch.created_at + 24 * 3600
        specs = [j.spec for j in queue.jobs.values()]
        assert sorted(s.custom_id or "" for s in specs) == [f"r{i}" for i in range(6)]
        assert {s.kind for s in specs} == {"batch"}
        assert {s.id for s in specs} == {job_id(batch.id, f"r{i}") for i in range(6)}
        assert {s.deadline for s in specs} == {float(batch.expires_at)}
        assert len({s.prefix_key for s in specs}) == 1
        assert {(s.tenant, s.key_id) for s in specs} == {("acme", "key-acme")}
        await queue.run(echo)
        done = await wait_status(client, batch.id, {"completed"})
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed,
                done.request_counts.failed) == (9, 6, 3)
        assert done.output_file_id and done.error_file_id
        assert done.completed_at and done.finalizing_at and done.in_progress_at
        out = content_lines((await client.files.content(done.output_file_id)).content)
        assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(6)]
        for o in out:
            assert o["error"] is None and o["id"] == job_id(batch.id, o["custom_id"])
            assert o["response"]["status_code"] == 200
            assert o["response"]["request_id"] == o["id"]
            number = o["custom_id"][1:]
            assert o["response"]["body"]["choices"][0]["message"]["content"] == \
                f"question {number}"
        errs = content_lines((await client.files.content(done.error_file_id)).content)
        assert sorted(e["error"]["code"] for e in errs) == [
            "duplicate_custom_id", "invalid_json_line", "mismatched_endpoint"]
        assert {e["error"]["line"] for e in errs} == {7, 8, 9}
        out_file = await client.files.retrieve(done.output_file_id)
        assert out_file.purpose == "batch_output"
        listed = await client.batches.list()
        assert [b.id for b in listed.data] == [batch.id]


@pytest.mark.parametrize(("raw", "code"), [
    (b"{", "invalid_json_line"),
    (b"[1]", "invalid_json_line"),
    (orjson.dumps(line(None)), "missing_required_parameter"),
    (orjson.dumps(line("a", method="GET")), "invalid_method"),
    (orjson.dumps(line("a", url="/v1/embeddings")), "mismatched_endpoint"),
    (orjson.dumps(line("a", body=[1])), "invalid_body"),
    (orjson.dumps(line("a", body={"messages": []})), "missing_required_parameter"),
    (orjson.dumps(line("a", body={"model": "m", "stream": True})), "invalid_body"),
    (orjson.dumps(line("a")), None),
])
def test_line_validation(raw: bytes, code: str | None) -> None:
    good, bad = validate_lines([raw], CHAT)
    if code is None:
        assert [g.custom_id for g in good] == ["a"] and bad == []
    else:
        assert good == [] and [b.code for b in bad] == [code] and bad[0].line == 1


async def test_all_lines_bad_fails_the_batch_with_errors(tmp_path: Path) -> None:
    queue = MemoryQueue()
    async with plane_app(tmp_path, queue) as app:
        client = sdk(app)
        f = await client.files.create(
            file=("in.jsonl", jsonl([line("a", url="/v1/completions"), line("b", method="PUT")])),
            purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                            completion_window="24h")
        assert batch.status == "failed" and batch.failed_at
        assert batch.errors is not None and batch.errors.data is not None
        assert [(e.code, e.line) for e in batch.errors.data] == [
            ("mismatched_endpoint", 1), ("invalid_method", 2)]
        assert queue.jobs == {}


async def test_errors_are_openai_shaped_and_tenants_are_isolated(tmp_path: Path) -> None:
    queue = MemoryQueue()
    async with plane_app(tmp_path, queue) as app:
        acme, other = sdk(app, "sk-acme"), sdk(app, "sk-other")
        f = await acme.files.create(file=("a.jsonl", jsonl([line("a")])), purpose="batch")
        batch = await acme.batches.create(input_file_id=f.id, endpoint=CHAT,
                                          completion_window="24h")
        for call in (other.files.retrieve(f.id), other.files.content(f.id),
                     other.files.delete(f.id), other.batches.retrieve(batch.id),
                     other.batches.cancel(batch.id),
                     other.batches.create(input_file_id=f.id, endpoint=CHAT,
                                          completion_window="24h")):
            with pytest.raises(openai.NotFoundError) as info:
                await call
            assert info.value.body is not None
        assert (await other.files.list()).data == []
        assert (await other.batches.list()).data == []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://mgmt") as raw:
            cases = [
                ("GET", "/v1/files", {}, None, 401, "authentication_error"),
                ("GET", "/v1/files/nope", {"authorization": "Bearer sk-acme"}, None, 404,
                 "invalid_request_error"),
                ("POST", "/v1/batches", {"authorization": "Bearer sk-acme"},
                 {"input_file_id": f.id, "endpoint": CHAT, "completion_window": "48h"}, 400,
                 "invalid_request_error"),
                ("POST", "/v1/batches", {"authorization": "Bearer sk-acme"},
                 {"input_file_id": f.id, "endpoint": "/v1/nope", "completion_window": "24h"},
                 400, "invalid_request_error"),
                ("POST", "/v1/batches", {"authorization": "Bearer sk-acme"},
                 {"input_file_id": f.id, "endpoint": CHAT, "completion_window": "24h",
                  "metadata": {str(i): "v" for i in range(17)}}, 400, "invalid_request_error"),
                ("PUT", "/v1/batches", {"authorization": "Bearer sk-acme"}, None, 405,
                 "invalid_request_error"),
                ("GET", "/v1/batches?limit=0", {"authorization": "Bearer sk-acme"}, None, 400,
                 "invalid_request_error"),
            ]
            for method, path, headers, body, status, kind in cases:
                resp = await raw.request(method, path, headers=headers, json=body)
                assert resp.status_code == status, (method, path, resp.text)
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["type"] == kind and err["message"]
        deleted = await acme.files.delete(f.id)
        assert deleted.deleted and deleted.id == f.id
        with pytest.raises(openai.NotFoundError):
            await acme.files.retrieve(f.id)


async def test_cancel_finishes_running_work_and_cancels_the_rest(tmp_path: Path) -> None:
    queue = MemoryQueue()
    async with plane_app(tmp_path, queue) as app:
        client = sdk(app)
        f = await client.files.create(
            file=("in.jsonl", jsonl([line(f"r{i}") for i in range(5)])), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                            completion_window="24h")
        await queue.run(echo, limit=2)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = await wait_status(client, batch.id, {"cancelled"})
        assert done.cancelling_at and done.cancelled_at
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 3)
        assert done.error_file_id is not None and done.output_file_id is not None
        errs = content_lines((await client.files.content(done.error_file_id)).content)
        assert {e["error"]["code"] for e in errs} == {"batch_cancelled"}
        again = await client.batches.cancel(batch.id)
        assert again.status == "cancelled"
        bad = await client.files.create(file=("x.jsonl", jsonl([line("a", url="/v1/x")])),
                                        purpose="batch")
        failed = await client.batches.create(input_file_id=bad.id, endpoint=CHAT,
                                             completion_window="24h")
        assert failed.status == "failed"
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(failed.id)


async def test_unstarted_requests_expire_and_engine_errors_go_to_the_error_file(
        tmp_path: Path) -> None:
    queue = MemoryQueue()
    rows = [line("ok"), line("bad", body={"model": "bad-model", "messages": []}),
            line("late")]
    async with plane_app(tmp_path, queue) as app:
        client = sdk(app)
        f = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                            completion_window="24h")
        await queue.run(echo, limit=2)
        await queue.expire_all()
        done = await wait_status(client, batch.id, {"expired"})
        assert done.expired_at
        assert done.output_file_id is not None and done.error_file_id is not None
        out = content_lines((await client.files.content(done.output_file_id)).content)
        assert [o["custom_id"] for o in out] == ["ok"]
        errs = {e["custom_id"]: e for e in content_lines(
            (await client.files.content(done.error_file_id)).content)}
        assert errs["bad"]["response"]["status_code"] == 404
        assert errs["bad"]["response"]["body"]["error"]["code"] == "model_not_found"
        assert errs["bad"]["error"] is None
        assert errs["late"]["response"] is None
        assert errs["late"]["error"]["code"] == "batch_expired"


async def test_a_restarted_plane_finishes_the_batch_and_racing_finalisers_agree(
        tmp_path: Path) -> None:
    queue = MemoryQueue()
    settings = {"finalize_interval_s": 3600.0}
    async with plane_app(tmp_path, queue, **settings) as app:
        client = sdk(app)
        f = await client.files.create(
            file=("in.jsonl", jsonl([line(f"r{i}") for i in range(20)])), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                            completion_window="24h")
    # the first process is gone; its jobs finish elsewhere (no listener of ours hears them)
    queue.listeners.clear()
    await queue.run(echo)
    cfg = ManagementSettings(data_dir=str(tmp_path), finalize_interval_s=3600.0)
    a = plane_of(build_management_app(queue, cfg))
    b = plane_of(build_management_app(queue, cfg))
    try:
        await asyncio.gather(a.batches.sweep(), b.batches.sweep())
        row_a = await a.batches.get("acme", batch.id)
        assert row_a.status == "completed"
        assert sum(a.batches.counters.finished.values()) + \
            sum(b.batches.counters.finished.values()) == 1
        assert row_a.output_file_id is not None
        out = (tmp_path / "files" / row_a.output_file_id).read_bytes().splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in out) == sorted(
            f"r{i}" for i in range(20))
        before = queue.submitted
        await a.batches.sweep()  # finished batches are left alone
        assert queue.submitted == before
    finally:
        await a.stop()
        await b.stop()


async def test_an_interrupted_validation_is_resumed_without_duplicates(tmp_path: Path) -> None:
    queue = MemoryQueue()

    class Flaky(MemoryQueue):
        calls = 0

        async def submit(self, specs: Any) -> int:
            Flaky.calls += 1
            if Flaky.calls == 2:  # the queue fails half-way through the batch
                from kvgate.asyncq.api import QueueUnavailable
                raise QueueUnavailable("store down")
            return await super().submit(specs)

    queue = Flaky()
    rows = [line(f"r{i}") for i in range(2500)]
    async with plane_app(tmp_path, queue, lease_s=0.2) as app:
        client = sdk(app)
        f = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                            completion_window="24h")
        assert batch.status == "validating"
        assert len(queue.jobs) == 1000
        done = await wait_status(client, batch.id, {"in_progress"})
        assert len(queue.jobs) == 2500 and queue.submitted == 2500
        assert done.request_counts is not None and done.request_counts.total == 2500
        await queue.run(echo)
        finished = await wait_status(client, batch.id, {"completed"})
        assert finished.request_counts is not None
        assert finished.request_counts.completed == 2500


@pytest.mark.parametrize(("rows", "settings", "status", "code"), [
    (3, {"max_file_lines": 2}, 400, "too_many_lines"),
    (50, {"max_file_bytes": 1000}, 413, "payload_too_large"),
    (1, {}, 200, None),
])
async def test_upload_limits(tmp_path: Path, rows: int, settings: dict[str, Any], status: int,
                             code: str | None) -> None:
    queue = MemoryQueue()
    async with plane_app(tmp_path, queue, **settings) as app, httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://mgmt") as raw:
        data = jsonl([line(f"r{i}") for i in range(rows)])
        resp = await raw.post("/v1/files", headers={"authorization": "Bearer sk-a"},
                              files={"file": ("in.jsonl", io.BytesIO(data))},
                              data={"purpose": "batch"})
        assert resp.status_code == status, resp.text
        if code is not None:
            assert resp.json()["error"]["code"] == code
            assert list((tmp_path / "files").glob("*")) == []
        else:
            assert resp.json()["bytes"] == len(data)
        wrong = await raw.post("/v1/files", headers={"authorization": "Bearer sk-a"},
                               files={"file": ("in.jsonl", io.BytesIO(data))},
                               data={"purpose": "fine-tune"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"


async def test_file_listing_pages_in_order(tmp_path: Path) -> None:
    rng = random.Random(7)
    queue = MemoryQueue(auth=False)
    async with plane_app(tmp_path, queue) as app:
        client = sdk(app)
        ids = []
        for i in range(rng.randint(5, 8)):
            ids.append((await client.files.create(
                file=(f"f{i}.jsonl", jsonl([line("a")])), purpose="batch")).id)
        seen: list[str] = []
        after: str | None = None
        while True:
            page = await client.files.list(limit=2, order="asc",
                                           after=after if after else openai.omit)
            seen += [x.id for x in page.data]
            if not page.has_more:
                break
            after = page.data[-1].id
        assert sorted(seen) == sorted(ids) and len(seen) == len(ids)
