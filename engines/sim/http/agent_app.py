"""The simulator's agent-API routes: Anthropic Messages
(:mod:`kvgate.engines.sim.http.messages_api`), OpenAI Responses
(:mod:`kvgate.engines.sim.http.responses_api`) and the token utilities
(:mod:`kvgate.engines.sim.http.tokens_api`), on the same engine as chat
(:class:`kvgate.engines.sim.http.app.SimApi` runs them: roles, prefix cache and faults alike).

Faults apply as to chat: ``delay_first_byte_s``, ``fail_next`` (the error in the route's own
shape) and ``drop_after_chunks`` for streams. A Responses ``background`` request answers at
once (``status: "queued"``) and finishes in a task owned by this object.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate.engines.sim.core.pd import InvalidTransferParams
from kvgate.engines.sim.http.agent_common import read_body
from kvgate.engines.sim.http.app import Run, SimApi
from kvgate.engines.sim.http.messages_api import (
    MessagesShaper,
    anthropic_error,
    count_tokens,
    parse_messages,
)
from kvgate.engines.sim.http.protocol import ApiError, ParsedRequest
from kvgate.engines.sim.http.responses_api import (
    ResponsesError,
    ResponsesRequest,
    ResponsesShaper,
    ResponseStore,
    StoredResponse,
    new_response_id,
    parse_responses,
)
from kvgate.engines.sim.http.streaming import EventStreamResponse, until_done_or_disconnect
from kvgate.engines.sim.http.tokens_api import TokensApi

_REQUEST_ID_HEADER = "x-request-id"


class AgentApi:
    """Route handlers of the agent APIs, bound to one engine's :class:`SimApi`."""

    def __init__(self, api: SimApi) -> None:
        self.api = api
        self.config = api.config
        self.store = ResponseStore(api.config.responses_store_limit)
        self.tokens = TokensApi(api.config, self.store)
        self._background: set[asyncio.Task[None]] = set()

    def routes(self) -> list[Route]:
        """Messages and Responses for a ``generate`` runner; the token utilities always."""
        if self.config.runner != "generate":
            return self.tokens.routes()
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
            *self.tokens.routes(),
        ]

    # ---- shared -----------------------------------------------------------------------------

    async def _faults(self, request: Request) -> None:
        faults = self.api.h.faults
        if faults.delay_first_byte_s > 0:
            await asyncio.sleep(faults.delay_first_byte_s)
        status = faults.take_failure(await request.body() if faults.match else b"")
        if status is not None:
            raise ApiError(status, faults.message)

    async def _submit(self, req: ParsedRequest, request_id: str) -> Run:
        try:
            handle, transfer = await self.api.execute(req, request_id)
        except InvalidTransferParams:
            raise ApiError(503, "invalid kv_transfer_params for this engine") from None
        return Run(req, handle, transfer, request_id)

    async def _text(self, request: Request, run: Run) -> str:
        """Wait for the whole answer (aborting if the client leaves); 503 if aborted."""
        handle = run.handle
        tokens = await until_done_or_disconnect(request.receive, handle.result(), handle.abort)
        self.api.finish_prefill(run)
        if handle.finish_reason == "abort":
            raise ApiError(503, "request aborted")
        return "".join(t.text for t in tokens)

    @staticmethod
    def _ids(request: Request) -> tuple[str, dict[str, str]]:
        request_id = request.headers.get(_REQUEST_ID_HEADER) or secrets.token_hex(16)
        return request_id, {_REQUEST_ID_HEADER: request_id}

    # ---- Anthropic Messages -----------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        request_id, headers = self._ids(request)
        try:
            await self._faults(request)
            run = await self._submit(parse_messages(await read_body(request), self.config),
                                     request_id)
            shaper = MessagesShaper("chatcmpl-" + request_id, run.req.model,
                                    self.config.block_size,
                                    self.config.enable_prompt_tokens_details)
            if run.req.stream:
                return EventStreamResponse(self._message_events(run, shaper), run.handle.abort,
                                           self.api.h.faults.take_drop(), headers)
            text = await self._text(request, run)
        except ApiError as exc:
            return JSONResponse(anthropic_error(exc), exc.status, headers)
        body = shaper.full(text, self.api.usage(run), run.handle.finish_reason)
        params = self.api.prefill_answer_params(request, run)
        if params is not None:
            body["kv_transfer_params"] = params
        return JSONResponse(body, headers=headers)

    async def _message_events(
        self, run: Run, shaper: MessagesShaper
    ) -> AsyncGenerator[bytes, None]:
        """``message_start`` with the first token, deltas, then the closing events; ends
        without them if the request was aborted."""
        handle = run.handle
        try:
            first = True
            async for tok in handle.tokens():
                if first:
                    for event in shaper.start(handle.prompt_tokens):
                        yield event
                    first = False
                yield shaper.delta(tok.text)
            if handle.finish_reason in (None, "abort"):
                return
            for event in shaper.end(self.api.usage(run), handle.finish_reason):
                yield event
        finally:
            handle.abort()
            self.api.finish_prefill(run)

    async def count_tokens(self, request: Request) -> Response:
        try:
            return JSONResponse(count_tokens(await read_body(request), self.config))
        except ApiError as exc:
            return JSONResponse(anthropic_error(exc), exc.status)

    # ---- OpenAI Responses -------------------------------------------------------------------

    async def responses(self, request: Request) -> Response:
        request_id, headers = self._ids(request)
        try:
            await self._faults(request)
            rr = parse_responses(await read_body(request), self.config, self.store)
            run = await self._submit(rr.req, request_id)
            shaper = ResponsesShaper(rr, new_response_id(rr.body), int(time.time()),
                                     self.config.block_size)
            if rr.background:
                return JSONResponse(self._start_background(rr, run, shaper), headers=headers)
            if rr.req.stream:
                return EventStreamResponse(self._response_events(rr, run, shaper),
                                           run.handle.abort, self.api.h.faults.take_drop(),
                                           headers)
            text = await self._text(request, run)
        except ApiError as exc:
            return JSONResponse(exc.body(), exc.status, headers)
        final = shaper.full(text, self.api.usage(run), run.handle.finish_reason)
        self._keep(rr, final)
        return JSONResponse(final, headers=headers)

    def _keep(self, rr: ResponsesRequest, final: dict[str, Any]) -> None:
        if rr.store:
            self.store.put(final["id"], StoredResponse(final, rr.messages))

    async def _response_events(
        self, rr: ResponsesRequest, run: Run, shaper: ResponsesShaper
    ) -> AsyncGenerator[bytes, None]:
        handle = run.handle
        try:
            for event in shaper.opening():
                yield event
            parts: list[str] = []
            async for tok in handle.tokens():
                parts.append(tok.text)
                yield shaper.delta(tok.text)
            if handle.finish_reason in (None, "abort"):
                return
            final = shaper.full("".join(parts), self.api.usage(run), handle.finish_reason)
            self._keep(rr, final)
            for event in shaper.closing(final):
                yield event
        finally:
            handle.abort()
            self.api.finish_prefill(run)

    def _start_background(
        self, rr: ResponsesRequest, run: Run, shaper: ResponsesShaper
    ) -> dict[str, Any]:
        queued = shaper.response("queued", [], None)
        entry = StoredResponse(queued, rr.messages, run.handle.abort)
        self.store.put(shaper.response_id, entry)
        task = asyncio.create_task(self._finish_background(run, shaper, entry))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return queued

    async def _finish_background(
        self, run: Run, shaper: ResponsesShaper, entry: StoredResponse
    ) -> None:
        entry.body = {**entry.body, "status": "in_progress"}
        tokens = await run.handle.result()
        self.api.finish_prefill(run)
        entry.abort = None
        if entry.body["status"] != "cancelled":
            entry.body = shaper.full("".join(t.text for t in tokens), self.api.usage(run),
                                     run.handle.finish_reason)

    async def retrieve(self, request: Request) -> Response:
        try:
            return JSONResponse(self.store.get(request.path_params["response_id"]).body)
        except ApiError as exc:
            return JSONResponse(exc.body(), exc.status)

    async def cancel(self, request: Request) -> Response:
        """vLLM's cancel: only a queued or running (background) response; 400 otherwise."""
        try:
            entry = self.store.get(request.path_params["response_id"])
            if entry.body["status"] not in ("queued", "in_progress"):
                raise ResponsesError(400, "Cannot cancel a synchronous response.",
                                     "response_id")
        except ApiError as exc:
            return JSONResponse(exc.body(), exc.status)
        entry.body = {**entry.body, "status": "cancelled"}
        if entry.abort is not None:
            entry.abort()
            entry.abort = None
        return JSONResponse(entry.body)
