"""Server-sent events: the response class (it watches for the client going away) and the frame helpers.

Each API family builds its own frames (:mod:`serve.routes.sglang`, :mod:`serve.routes.openai`) from the
``(index, chunk, delta)`` triples of :meth:`serve.state.Batch.deltas`; provisional chunks (the block being
denoised, ``stream_provisional``) come through the same iterator, flagged ``chunk["provisional"]``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """Server-sent events that watch for the client going away (and then cancel the stream) and always run
    ``on_close(client_gone)`` at the end, even if the stream never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[bool], None]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        gone = False
        finished = False
        try:
            async with anyio.create_task_group() as tg:
                async def run_stream():
                    nonlocal gone, finished
                    try:
                        await self.stream_response(send)
                        finished = True
                    except OSError:
                        gone = True
                    tg.cancel_scope.cancel()

                async def watch():
                    nonlocal gone
                    await self.listen_for_disconnect(receive)
                    gone = not finished
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await self.body_iterator.aclose()
                self._on_close(gone or not finished)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
