"""``python -m bench provisional``: what provisional streaming costs a server (issue 18).

One ``dllm-jax serve`` process on the shipped model; 16 concurrent clients each stream 4 held-out chat prompts
(one after another) from ``/v1/chat/completions``, once plain and once with ``stream_provisional: true`` (the block being denoised after
every step), alternately, three rounds of each. Reported: wall time of the 16 streams, tokens/s, frames received
(provisional and committed), and the ratio. The outputs of both modes must be identical.
"""

from __future__ import annotations

import asyncio
import json
import time

from bench.common import Ctx, table
from bench.startup import _env

ROUNDS = 5
CLIENTS = 16  # concurrent streams
PER_CLIENT = 4  # prompts each client streams one after another


async def _streams(base: str, prompts: list[str], provisional: bool, max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        async def one(prompt):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_provisional": provisional}
            text, frames, prov = "", 0, 0
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    frames += 1
                    for choice in json.loads(line[6:]).get("choices", []):
                        delta = choice.get("delta", {})
                        text += delta.get("content") or ""
                        prov += bool((delta.get("dllm_block") or {}).get("provisional"))
            return text, frames, prov

        async def client(k):  # one of CLIENTS concurrent streams, its prompts one after another
            return [await one(p) for p in prompts[k::CLIENTS]]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(k) for k in range(CLIENTS))) for r in rs]
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "texts": [r[0] for r in results], "frames": sum(r[1] for r in results),
            "provisional_frames": sum(r[2] for r in results)}


def provisional(ctx: Ctx) -> dict:
    import tempfile

    from dllm_jax.train import tasks
    from serve.launch import ServerProcess

    m = ctx.model("shipped")
    n = CLIENTS
    prompts = [ex.prompt for ex in tasks.heldout_set(CLIENTS * PER_CLIENT)]
    server = ServerProcess(["--model-path", m.path, "--max-running-requests", str(n), "--context-length", "256",
                            "--log-level", "warning", "--no-access-log"],
                           env=_env(tempfile.mkdtemp(prefix="dllm-bench-prov-")))
    with server:
        asyncio.run(_streams(server.base, prompts, False, 160))  # warm: every bucket these streams use
        asyncio.run(_streams(server.base, prompts, True, 160))
        runs = {False: [], True: []}
        for _ in range(ROUNDS):
            for mode in (False, True):
                runs[mode].append(asyncio.run(_streams(server.base, prompts, mode, 160)))
    best = {mode: min(rs, key=lambda r: r["wall_s"]) for mode, rs in runs.items()}
    identical = best[False]["texts"] == best[True]["texts"]
    tokens = sum(len(m.tokenizer.encode(t)) for t in best[False]["texts"])
    rows = [[label, r["wall_s"], tokens / r["wall_s"], r["frames"], r["provisional_frames"]]
            for label, r in (("plain", best[False]), ("stream_provisional", best[True]))]
    overhead = best[True]["wall_s"] / best[False]["wall_s"]
    text = table(f"provisional: 16 concurrent chat streams x 4 prompts over HTTP (best of {ROUNDS}); with / without = "
                 f"{overhead:.3f}x, identical text: {identical}",
                 ["mode", "wall s", "tokens/s", "frames", "provisional frames"], rows)
    from bench.scenarios import finish

    result = {"overhead": overhead, "identical": identical,
              "runs": {str(k): [{x: r[x] for x in ("wall_s", "frames", "provisional_frames")} for r in v]
                       for k, v in runs.items()}}
    return finish(ctx, "provisional", result, text)
