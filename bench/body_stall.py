"""``python -m bench.body_stall --base http://127.0.0.1:30000 [--pid PID]``: what one hostile JSON body costs everyone
else (issue 49). Against a running server, for each body below: its answer (status, seconds), ``/health``'s latency
while it is parsed (polled every 20 ms from another connection: median and max) and, with ``--pid``, the server's
resident memory before, at its peak and 2 s after.

Bodies (each under the default 8 MiB ``--max-request-bytes``): 700,000 top-level keys, 700,000 keys in
``sampling_params``, 100,000 top-level keys, 175,000 chat messages, 99,000 unknown keys over 1,000 ``sampling_params``
objects (under the key limits), and for comparison two large bodies that are not hostile: a 1 M-token
``input_ids`` list and a batch of 10,000 prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx


def bodies() -> list[tuple[str, str, bytes]]:
    keys = {f"{i:x}": 1 for i in range(700_000)}  # short keys: 8.3 MB with compact separators
    return [
        ("700k top-level keys", "/generate", _dumps({"text": "hi", **keys}).encode()),
        ("700k keys in sampling_params", "/generate",
         _dumps({"text": "hi", "sampling_params": keys}).encode()),
        ("100k top-level keys", "/generate",
         _dumps({"text": "hi", **{f"{i:x}": 1 for i in range(100_000)}}).encode()),
        ("175k chat messages", "/v1/chat/completions",
         _dumps({"messages": [{"role": "user", "content": "x"}] * 175_000, "max_tokens": 1}).encode()),
        ("99k unknown keys in 1,000 sampling_params", "/generate",
         _dumps({"text": ["hi"] * 1000, "sampling_params": [{f"{i:x}": 1 for i in range(99)}] * 1000}).encode()),
        ("1M token ids (not hostile)", "/generate",
         _dumps({"input_ids": [5] * 1_000_000, "sampling_params": {"max_new_tokens": 1}}).encode()),
        ("10,000 prompts (not hostile)", "/generate",
         _dumps({"text": [f"Count by twos from {i}." for i in range(10_000)],
                 "sampling_params": {"max_new_tokens": 1}}).encode()),
    ]


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def measure(base: str, name: str, path: str, body: bytes, pid: int | None) -> dict:
    stop = threading.Event()
    health: list[tuple[float, float]] = []  # (start, seconds)
    peak = [rss_mb(pid) or 0.0]

    def poll():
        with httpx.Client(base_url=base, timeout=60) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get("/health")
                health.append((t, time.perf_counter() - t))
                if pid is not None:
                    peak[0] = max(peak[0], rss_mb(pid) or 0.0)
                time.sleep(0.02)

    before = rss_mb(pid)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.3)
    with httpx.Client(base_url=base, timeout=120) as c:
        t0 = time.perf_counter()
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        t1 = time.perf_counter()
    time.sleep(0.3)
    stop.set()
    poller.join()
    time.sleep(2.0)
    during = [s for t, s in health if t0 - 0.02 <= t <= t1] or [0.0]
    # a /health asked before the body arrived but answered after it was parsed waited for it too
    waited = [s for t, s in health if t < t1 and t + s > t0] or [0.0]
    try:
        message = r.json()["error"]["message"][:100]
    except Exception:
        message = ""
    return {"body": name, "MB": round(len(body) / 1e6, 1), "status": r.status_code, "seconds": round(t1 - t0, 3),
            "health_median_ms": round(statistics.median(during) * 1e3, 1),
            "health_max_ms": round(max(waited) * 1e3, 1), "rss_before_mb": before, "rss_peak_mb": peak[0] or None,
            "rss_after_mb": rss_mb(pid), "message": message}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="http://127.0.0.1:30000")
    p.add_argument("--pid", type=int, default=None, help="the server's process id (for its resident memory)")
    p.add_argument("--only", default=None, help="run only the bodies whose name contains this")
    args = p.parse_args(argv)
    for name, path, body in bodies():
        if args.only and args.only not in name:
            continue
        out = measure(args.base, name, path, body, args.pid)
        print(_dumps(out), flush=True)


if __name__ == "__main__":
    main()
