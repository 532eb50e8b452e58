"""``python -m bench.dp``: one replica against N behind SGLang's router, and what the router adds per request.

Each configuration is a real ``python -m serve --dp K`` service (:mod:`serve.dp`: K workers, the router in front,
policy ``--policy``), started fresh and warmed up by a few requests before it is timed:

* **throughput**: ``--requests`` chat requests over the shipped model's held-out prompts (every task; answers of
  30-100 tokens, greedy), ``--concurrency`` at a time, through the router of ``--dp 1`` and of ``--dp N``: requests
  and completion tokens per second, latency p50 / p90, and how many answers were right (a check that the replicas
  answer as one engine does). On a CPU both runs use the same cores (``--worker-cpus split``: one worker gets them
  all; N workers get a share each), so N replicas buy no compute there: the number says what the split costs or
  gains (XLA's per-op threading against N engines' overlap of host and device work). On N GPUs each worker has its
  own GPU (one replica: the first GPU only).
* **router latency**: on the ``--dp 1`` service, the same requests one at a time, alternately straight to the
  worker and through the router (same worker, same process): median latency both ways and their difference, for a
  one-block ``/generate`` (max_new_tokens 1: the engine's share is small) and a full chat answer.

Prints a table and writes ``--out`` (JSON). ``--smoke``: a few requests (checks the script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time

from serve.dp import free_port_base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine() -> dict:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    from serve.dp import visible_gpus

    return {"cpus": len(cpus), "cpu_model": model or platform.processor(), "gpus": visible_gpus(),
            "python": platform.python_version()}


class Service:
    """``python -m serve --dp K`` in a child process, until :meth:`stop`."""

    def __init__(self, dp: int, args: argparse.Namespace, log_path: str, gpus: list[str]):
        self.port = free_port_base(dp)
        self.base = f"http://127.0.0.1:{self.port}"
        self.workers = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(dp)]
        env = dict(os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"]
                                                  if os.environ.get("PYTHONPATH") else ""))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:dp])
        cmd = [sys.executable, "-m", "serve", "--dp", str(dp), "--port", str(self.port), "--router-policy",
               args.policy, "--no-access-log", "--max-running-requests", str(args.max_running_requests),
               "--worker-restarts", "0", *(["--model-path", args.model_path] if args.model_path else [])]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float) -> float:
        while time.perf_counter() - self.started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited {self.proc.returncode}:\n{self.output()[-4000:]}")
            if re.search(r"ready on http://\S+ \(SGLang's router", self.output()):
                return time.perf_counter() - self.started
            time.sleep(0.2)
        raise RuntimeError(f"not ready within {timeout:.0f} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self.log.close()
        return status


def workload(count: int) -> list:
    from dllm_jax.train.tasks import heldout_set

    return heldout_set(min(count, 600))


async def _throughput(base: str, examples: list, concurrency: int, max_tokens: int) -> dict:
    import httpx

    from dllm_jax.train.tasks import is_correct

    sem = asyncio.Semaphore(concurrency)
    latencies, tokens, right, errors = [], [], 0, 0
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) \
            as client:
        async def one(ex):
            nonlocal right, errors
            async with sem:
                t = time.perf_counter()
                r = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": ex.prompt}], "max_tokens": max_tokens})
                latencies.append(time.perf_counter() - t)
            if r.status_code != 200:
                errors += 1
                return
            out = r.json()
            tokens.append(out["usage"]["completion_tokens"])
            right += is_correct(ex, out["choices"][0]["message"]["content"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(ex) for ex in examples))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"requests": len(examples), "concurrency": concurrency, "wall_s": wall,
            "requests_per_s": len(examples) / wall, "tokens_per_s": sum(tokens) / wall,
            "completion_tokens": sum(tokens), "p50_s": lat[len(lat) // 2], "p90_s": lat[int(len(lat) * 0.9)],
            "right": right, "errors": errors}


def _latency(direct: str, router: str, body_path: str, body: dict, samples: int) -> dict:
    """Median latency of the same request straight to the worker and through the router, interleaved."""
    import httpx

    times = {"direct": [], "router": []}
    with httpx.Client(timeout=120) as client:
        for base in (direct, router):  # one untimed each: connections open, programs warm
            client.post(base + body_path, json=body).raise_for_status()
        for i in range(samples):
            for name, base in ((("direct", direct), ("router", router)) if i % 2 == 0
                               else (("router", router), ("direct", direct))):
                t = time.perf_counter()
                client.post(base + body_path, json=body).raise_for_status()
                times[name].append(time.perf_counter() - t)
    d, r = statistics.median(times["direct"]), statistics.median(times["router"])
    return {"samples": samples, "direct_ms": 1e3 * d, "router_ms": 1e3 * r, "added_ms": 1e3 * (r - d),
            "direct_p90_ms": 1e3 * sorted(times["direct"])[int(samples * 0.9)],
            "router_p90_ms": 1e3 * sorted(times["router"])[int(samples * 0.9)]}


def run(args: argparse.Namespace) -> dict:
    info = machine()
    gpus = info["gpus"]
    n = args.workers
    if gpus and len(gpus) < n:
        raise SystemExit(f"bench.dp: {n} workers need {n} GPUs; {len(gpus)} visible")
    examples = workload(args.requests)
    warm = workload(8)
    out = {"machine": info, "policy": args.policy, "workers": n, "max_tokens": args.max_tokens, "runs": {}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    for dp in (1, n):
        log_path = os.path.splitext(args.out)[0] + f".dp{dp}.log"
        svc = Service(dp, args, log_path, gpus)
        try:
            ready = svc.wait_ready(args.start_timeout)
            asyncio.run(_throughput(svc.base, warm, min(args.concurrency, 8), args.max_tokens))  # warm up
            run = asyncio.run(_throughput(svc.base, examples, args.concurrency, args.max_tokens))
            run["start_s"] = ready
            if dp == 1:
                one_block = {"text": "<|im_start|>user\nCount up 11 steps from 71.<|im_end|>\n<|im_start|>assistant\n",
                             "sampling_params": {"max_new_tokens": 1}}
                chat = {"messages": [{"role": "user", "content": "Count up 11 steps from 71."}], "max_tokens": 128}
                out["router_latency"] = {
                    "generate_one_block": _latency(svc.workers[0], svc.base, "/generate", one_block, args.samples),
                    "chat_answer": _latency(svc.workers[0], svc.base, "/v1/chat/completions", chat, args.samples)}
            out["runs"][f"dp{dp}"] = run
        finally:
            status = svc.stop()
            out["runs"].setdefault(f"dp{dp}", {})["exit_status"] = status
        if n == 1:
            break
    a, b = out["runs"].get("dp1", {}), out["runs"].get(f"dp{n}", {})
    if a.get("tokens_per_s") and b.get("tokens_per_s"):
        out["speedup"] = b["tokens_per_s"] / a["tokens_per_s"]
    return out


def report(out: dict) -> str:
    m = out["machine"]
    where = (f"{len(m['gpus'])} GPU(s) {','.join(m['gpus'])}" if m["gpus"]
             else f"CPU: {m['cpus']} cores ({m['cpu_model']}), the same cores for every configuration")
    lines = [f"bench.dp on {where}; policy {out['policy']}; chat requests, greedy, max_tokens {out['max_tokens']}",
             "| replicas | requests | concurrency | req/s | tok/s | p50 s | p90 s | right | errors | start s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["runs"].items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name[2:]} | (failed, exit {r.get('exit_status')}) |||||||||")
            continue
        lines.append(f"| {name[2:]} | {r['requests']} | {r['concurrency']} | {r['requests_per_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['p50_s']:.3f} | {r['p90_s']:.3f} | {r['right']}/{r['requests']} | "
                     f"{r['errors']} | {r['start_s']:.0f} |")
    if "speedup" in out:
        lines.append(f"{out['workers']} replicas / 1: {out['speedup']:.2f}x tokens per second")
    lat = out.get("router_latency")
    if lat:
        lines += ["", "router's added latency (one worker; the same requests alternately direct and through it):",
                  "| request | samples | direct ms (p50) | router ms (p50) | added ms | direct p90 | router p90 |",
                  "|---|---|---|---|---|---|---|"]
        for name, x in lat.items():
            lines.append(f"| {name} | {x['samples']} | {x['direct_ms']:.2f} | {x['router_ms']:.2f} | "
                         f"{x['added_ms']:+.2f} | {x['direct_p90_ms']:.2f} | {x['router_p90_ms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dp", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="replicas of the second configuration (default 2)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--samples", type=int, default=40, help="latency samples each way")
    p.add_argument("--policy", default="round_robin", help="the router's policy (default round_robin)")
    p.add_argument("--max-running-requests", type=int, default=32, help="per worker")
    p.add_argument("--model-path", default=None)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--out", default="bench_out/dp.json")
    p.add_argument("--smoke", action="store_true", help="a few requests: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.samples = 12, 4, 4
    out = run(args)
    text = report(out)
    print(text)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if all("tokens_per_s" in r for r in out["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
