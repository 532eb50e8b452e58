"""``dllm-jax serve --dp N``: N replicas of the server behind SGLang's router (``sglang-router``), one command.

This process serves nothing itself: it starts N worker processes (``python -m serve`` with the same flags), each
on its own devices (GPUs: ``CUDA_VISIBLE_DEVICES`` split into N equal groups; CPU: this process's cores split into
N groups with ``sched_setaffinity``, or shared with ``--worker-cpus shared``) and its own port on 127.0.0.1
(``--worker-port-start``, default the router's port + 1), waits until each answers ``/health``, then starts the
router on ``--host`` / ``--router-port`` (default ``--port``) with ``--policy`` from ``--router-policy`` and the
worker URLs. The data-parallel logic is the router's (policies, health checks, retries, circuit breakers); we write
no router of our own (DESIGN.md, "Constraints and scale-out").

Then it supervises: a worker that exits on its own is restarted on the same port and devices after
``--worker-restart-delay`` seconds (``--worker-restarts`` times; the router's health check takes it back), a router
that exits stops everything. SIGTERM / SIGINT: every child gets SIGTERM at once (the workers drain for
``--shutdown-timeout``, the router waits for what it forwards), then SIGKILL whatever is left after that; a second
signal kills at once. Every child's output is copied to stderr, each line prefixed with ``[worker i]`` or
``[router]``. The children run in their own sessions (a terminal's Ctrl-C reaches only the launcher, which stops
them in order) and get SIGTERM if the launcher dies.

The launcher's defaults for the router (each overridable in ``--router-args``): health checks every 2 s
(SGLang's default is 60 s: a dead worker would keep its share of requests for minutes), its load monitor every
2 s, its own log at ``warn`` (``info`` with ``--log-level debug``), Prometheus metrics on 29000 or, when taken, a
free port, and a shutdown grace period of the workers' ``--shutdown-timeout`` + 5 s. ``--api-key`` protects the
router and the workers alike (the router sends it to them).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger("dllm_jax.serve")

# the launcher's own flags: not passed to the workers (the API key goes to them in their environment, not on a
# command line that any local user can read)
DP_DESTS = {"dp", "router_policy", "router_port", "worker_port_start", "router_args", "worker_restarts",
            "worker_restart_delay", "worker_cpus", "host", "port", "api_key"}
POLL_S = 0.25
WORKER_START_TIMEOUT_S = 900.0  # a first start compiles every shape bucket


def worker_argv(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """``python -m serve`` flags that rebuild ``args`` (every flag whose value differs from its default), less the
    launcher's own: each worker runs with exactly the user's server and engine options."""
    if parser is None:
        from serve.args import build_parser

        parser = build_parser()
    out, seen = [], set()
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in DP_DESTS or dest in seen or dest == "help":
            continue
        value = getattr(args, dest, action.default)
        if value == action.default:
            continue
        seen.add(dest)
        longs = [s for s in action.option_strings if s.startswith("--")] or action.option_strings
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(longs[0] if value else next(s for s in longs if s.startswith("--no-")))
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
            out.append(longs[0])
        else:
            out.append(f"{longs[0]}={value}")
    return out


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else what ``nvidia-smi`` lists, else
    none (a CPU machine). Asks no JAX (which would take every GPU's memory in this process)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" or shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def device_groups(n: int, gpus: list[str], cpus: list[int], cpu_mode: str, tp: int | None) -> list[dict]:
    """Each worker's devices: ``{"gpus": [...]}`` (N equal groups of the GPUs) or ``{"cpus": [...]}`` (N groups
    of the cores, or all of them when shared or when there are fewer cores than workers)."""
    if gpus:
        per = len(gpus) // n
        if per == 0:
            raise ValueError(f"dp: {n} workers but {len(gpus)} GPU(s) visible ({','.join(gpus)})")
        if tp is not None and tp > per:
            raise ValueError(f"tensor_parallel_size: {tp} GPUs per worker, but {len(gpus)} GPU(s) / {n} workers "
                             f"gives each {per}")
        return [{"gpus": gpus[i * per:(i + 1) * per]} for i in range(n)]
    if cpu_mode == "shared" or len(cpus) < n:
        return [{"cpus": list(cpus)} for _ in range(n)]
    per = len(cpus) // n
    return [{"cpus": cpus[i * per:(i + 1) * per]} for i in range(n)]


def free_port(preferred: int | None = None) -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port")


def free_port_base(count: int) -> int:
    """A port P with P .. P + count all free on 127.0.0.1 (a router and ``count`` workers; tests and bench.dp)."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError("no free port range")


def router_command(args: argparse.Namespace, urls: list[str]) -> list[str]:
    grace = int(args.shutdown_timeout) + 5
    level = "info" if args.log_level == "debug" else "warn"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.router_port),
           "--worker-urls", *urls, "--policy", args.router_policy, "--log-level", level,
           "--health-check-interval-secs", "2", "--worker-startup-check-interval", "2",
           "--shutdown-grace-period-secs", str(grace), "--prometheus-port", str(free_port(29000))]
    key = args.api_key or os.environ.get("DLLM_JAX_API_KEY")
    if key:
        cmd += ["--api-key", key]
    return cmd + shlex.split(args.router_args or "")


class Child:
    """One child process, its output copied to stderr line by line under a prefix."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None, cpus: list[int] | None = None):
        self.name, self.cmd, self.env, self.cpus = name, cmd, env, cpus
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        self.restarts = 0
        self.exited_at: float | None = None  # when the supervisor saw it exit

    def start(self) -> "Child":
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=functools.partial(_in_child, self.cpus))
        threading.Thread(target=self._copy, args=(self.proc.stdout,), daemon=True).start()
        return self

    def _copy(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            try:
                sys.stderr.write(f"[{self.name}] {raw.decode('utf-8', 'replace')}")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        stream.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def _in_child(cpus: list[int] | None) -> None:
    """In the child before it runs: its own session (a terminal's Ctrl-C reaches the launcher only, which then
    stops the children in order), SIGTERM when the launcher dies (Linux), and its cores."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def wait_http(url: str, proc: Child, timeout: float, stop: threading.Event, ok=lambda status: status == 200) -> bool:
    """Poll ``url`` until it answers ``ok``; False when the process exits, the time is up or a stop was asked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if not proc.alive():
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if ok(r.status):
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        stop.wait(POLL_S)
    return False


class Replicas:
    """The workers and the router of one ``--dp`` service."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.stop = threading.Event()
        self.hurry = False
        n = args.dp
        args.router_port = args.router_port if args.router_port is not None else args.port
        start = args.worker_port_start if args.worker_port_start is not None else args.router_port + 1
        self.ports = [start + i for i in range(n)]
        if args.router_port in self.ports:
            raise ValueError(f"router_port: {args.router_port} is also a worker's port ({start}..{start + n - 1})")
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.groups = device_groups(n, visible_gpus(), cpus, args.worker_cpus, args.tensor_parallel_size)
        flags = worker_argv(args)
        key = args.api_key or os.environ.get("DLLM_JAX_API_KEY")
        self.workers = []
        for i, (port, group) in enumerate(zip(self.ports, self.groups)):
            env = dict(os.environ)
            if "gpus" in group:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(group["gpus"])
            if key:
                env["DLLM_JAX_API_KEY"] = key
            cmd = [sys.executable, "-m", "serve", *flags, "--host", "127.0.0.1", "--port", str(port)]
            self.workers.append(Child(f"worker {i}", cmd, env, group.get("cpus")))
        self.router = Child("router", router_command(args, self.urls))

    def describe(self, i: int) -> str:
        g = self.groups[i]
        devices = f"GPU {','.join(g['gpus'])}" if "gpus" in g else f"CPU {_ranges(g['cpus'])}" if g["cpus"] else "CPU"
        return f"worker {i} (pid {self.workers[i].pid}) on {self.urls[i]}, {devices}"

    def start(self) -> bool:
        for i, w in enumerate(self.workers):
            w.start()
            log.info("started %s", self.describe(i))
        for i, w in enumerate(self.workers):
            if not wait_http(self.urls[i] + "/health", w, WORKER_START_TIMEOUT_S, self.stop):
                if not self.stop.is_set():
                    log.error("worker %d did not start (exit status %s)", i, w.proc.poll())
                return False
        self.router.start()
        base = f"http://127.0.0.1:{self.args.router_port}"
        if not wait_http(base + "/health", self.router, 120.0, self.stop):
            if not self.stop.is_set():
                log.error("the router did not start (exit status %s)", self.router.proc.poll())
            return False
        host = f"[{self.args.host}]" if ":" in self.args.host else self.args.host
        log.info("ready on http://%s:%d (SGLang's router, policy %s, %d workers: %s)", host, self.args.router_port,
                 self.args.router_policy, len(self.workers), " ".join(self.urls))
        return True

    def supervise(self) -> int:
        """Until a signal: restart workers that exit on their own; stop everything if the router exits."""
        while not self.stop.wait(POLL_S):
            if not self.router.alive():
                log.error("the router exited (status %s): stopping the workers", self.router.proc.poll())
                return 1
            for i, w in enumerate(self.workers):
                if w.alive() or w.stopping:
                    continue
                status = w.proc.poll()
                if w.exited_at is None:
                    w.exited_at = time.monotonic()
                    if w.restarts < self.args.worker_restarts:
                        log.warning("worker %d exited (status %s): restarting it in %g s", i, status,
                                    self.args.worker_restart_delay)
                if w.restarts >= self.args.worker_restarts:
                    log.error("worker %d exited (status %s); no restarts left: the router routes around it", i,
                              status)
                    w.stopping = True
                    continue
                if time.monotonic() - w.exited_at < self.args.worker_restart_delay:
                    continue
                w.restarts += 1
                w.exited_at = None
                w.start()
                log.info("restarted %s (%d/%d)", self.describe(i), w.restarts, self.args.worker_restarts)
        return 0

    def shutdown(self) -> None:
        """SIGTERM to every child at once, then SIGKILL after the drain time (at once on a second signal)."""
        children = [self.router, *self.workers]
        for c in children:
            c.stopping = True
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + 15
        while any(c.alive() for c in children) and time.monotonic() < deadline and not self.hurry:
            time.sleep(0.05)
        for c in children:
            if c.alive():
                log.warning("%s did not stop in time: killed", c.name)
                c.signal(signal.SIGKILL)
        for c in children:
            if c.proc is not None:
                c.proc.wait()


def _ranges(cpus: list[int]) -> str:
    if not cpus:
        return ""
    out, start, prev = [], cpus[0], cpus[0]
    for c in cpus[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def check(args: argparse.Namespace) -> None:
    if args.dp < 1:
        raise ValueError(f"dp: must be >= 1, got {args.dp}")
    if args.worker_restarts < 0:
        raise ValueError(f"worker_restarts: must be >= 0, got {args.worker_restarts}")
    if args.coordinator_address or args.num_processes not in (None, 1):
        raise ValueError("dp: --dp starts single-process workers on this host; for workers that are multi-process "
                         "groups, start each group and sglang-router yourself (README, 'Data parallel')")
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("dp: needs SGLang's router: pip install 'dllm-jax[router]' (or sglang-router)")


def main(args: argparse.Namespace) -> int:
    """Launch, supervise, and shut down on SIGTERM / SIGINT (exit 0), or exit 1 when a worker or the router fails
    to start or the router dies."""
    from dllm_jax.cli import configure_logging

    configure_logging(args.log_level)
    check(args)
    replicas = Replicas(args)

    def on_signal(sig, frame):
        if replicas.stop.is_set():
            replicas.hurry = True
            return
        log.info("%s: shutting down the router and %d workers", signal.Signals(sig).name, len(replicas.workers))
        replicas.stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = 0 if replicas.start() else 1
        if status == 0:
            status = replicas.supervise()
        if replicas.stop.is_set():
            status = 0
    finally:
        replicas.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("shut down")
    return status
