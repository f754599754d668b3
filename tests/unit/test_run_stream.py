"""A streamed answer ends its run however the response ends, even when the client is gone before the body's
generator ever starts (Starlette then cancels the response without starting it)."""

from __future__ import annotations

import asyncio

from waferscale.api.server import RunStream


class RecordingRun:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_stream_cancelled_before_its_first_chunk_still_closes_its_run():
    started = []

    async def body():
        started.append(True)
        yield "data: x\\n\\n"

    async def receive():
        return {"type": "http.disconnect"}  # the client is already gone

    async def send(message):
        await asyncio.sleep(0)

    run = RecordingRun()
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(RunStream(body(), run)(scope, receive, send))
    assert started == []  # the scenario: the generator never ran, so its own cleanup could not
    assert run.closed == 1


def test_a_stream_that_runs_to_its_end_closes_its_run_once():
    async def body():
        yield "data: [DONE]\\n\\n"

    async def receive():
        await asyncio.sleep(3600)

    sent = []

    async def send(message):
        sent.append(message)

    run = RecordingRun()
    asyncio.run(RunStream(body(), run)({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
    assert run.closed == 1 and any(m.get("body") for m in sent)
