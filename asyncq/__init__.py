"""Async inference: the durable job queue, its runner, queued requests, background responses
and (with kvgate.asyncq.batch.mgmt) the OpenAI Batch API. See docs/async.md."""
