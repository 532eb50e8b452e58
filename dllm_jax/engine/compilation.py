"""Compilation: the padded shapes of the device calls (buckets), which executables exist, warm-up, compiling
off the scheduler's thread, and the count of executables obtained.

Buckets (every dimension a power of two, so a handful of executables serve all traffic):

* denoise rows: 1, 2, 4, ... up to ``max_rows`` (the engine's ``max_running_requests``, rounded up; twice that
  with commit folding, for the refresh rows);
* prefill: one row per request holding a chunk of C consecutive complete blocks (block-causal attention inside
  the chunk, the prefix gathered once per row); C in 1, 2, 4, ... and rows in 1, 2, 4, ... with
  rows x C <= ``max_prefill_tokens / B``: one long prompt is a single row of many blocks, many short prompts are
  many rows of few blocks;
* page-table width (prefix pages per row): 1, 2, 4, ... up to ``ceil(context_length / B)``.
``Engine(shape_buckets=...)`` replaces any of these lists (fewer buckets: fewer compiles, more padding; see
:class:`ShapeBuckets`).

Step variants: a denoise call compiles (per bucket) the plain step, or a variant when some row samples
(``sampling``), has a penalty / bias (``VARIANT_PENALTIES``: the call carries fixed-width penalty tables) or wants
log probabilities (``VARIANT_LOGPROBS``, and ``VARIANT_TOP`` when some row wants alternatives) or is constrained by
a grammar (``VARIANT_GRAMMAR``: the call carries a bitmask per row). A batch without them runs the plain step.

A call's **key** is a named tuple of its bucket: :class:`DenoiseKey` ``(kind, rows, width, sampled, variant)`` or
:class:`PrefillKey` ``(kind, rows, blocks, width)`` (DiffusionGemma's runner has its own, with a ``kind`` too). :meth:`Compiler.warmup` compiles a list of keys ahead of time; afterwards nothing it covered
compiles again (a test counts :func:`compiled_executables`). A key whose step variant warm-up did not cover compiles
on one background thread (:meth:`Compiler.compile_soon`) while the scheduler runs the calls that do not need it.

A staged warm-up (``Engine.warmup(background=True)``, ``dllm-jax serve``'s) compiles only the keys a short chat needs
(:func:`staged_keys`) and leaves the rest to that thread, fewer rows and narrower tables first; until a key is
compiled its calls run in a larger compiled bucket (:func:`fit_key`, :func:`prefill_fit`) or wait for it, and a key
a call waits for is compiled before the others.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
from typing import Callable, NamedTuple

import jax

from pallas_kernels import next_pow2

# Denoise variants, as bits (a call's header carries them above its kind; followers shape their arrays from it).
VARIANT_PENALTIES, VARIANT_LOGPROBS, VARIANT_TOP, VARIANT_GRAMMAR = 1, 2, 4, 8


class DenoiseKey(NamedTuple):
    kind: str  # "denoise"
    rows: int
    width: int  # page-table width
    sampled: bool  # the sampling step (some row draws)
    variant: int  # VARIANT_* bits

    @property
    def step_class(self) -> tuple[bool, int]:
        """The compiled step a key uses, whatever its shape (warm-up covers a class for every bucket or not)."""
        return self.sampled, self.variant


class PrefillKey(NamedTuple):
    kind: str  # "prefill"
    rows: int
    blocks: int  # per row
    width: int


def pow2_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two that holds ``limit``."""
    return tuple(1 << k for k in range(next_pow2(limit).bit_length()))


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """The static shapes of the device calls. A call is padded up to the smallest bucket that holds it.

    ``rows``: denoise rows per call (decode rows plus, with commit folding, refresh rows); ``pages``: page-table
    widths (prefix pages per row); ``prefill_blocks``: blocks per prefill row (the largest is the prefill budget,
    in blocks per call); ``prefill_rows``: rows per prefill call (a bucket of R > 1 rows serves chunks of C
    blocks only if R x C fits the budget). Defaults: powers of two up to what the engine's limits need.
    """

    rows: tuple[int, ...]
    pages: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    prefill_blocks: tuple[int, ...]

    @property
    def prefill_budget(self) -> int:
        return self.prefill_blocks[-1]

    def prefill_rows_for(self, chunk: int) -> tuple[int, ...]:
        return tuple(r for r in self.prefill_rows if r == 1 or r * chunk <= self.prefill_budget)

    def larger(self, key: tuple, chain_rows: frozenset = frozenset()) -> list[tuple]:
        """The buckets of ``key``'s step that hold its call: rows and width (denoise) or rows and blocks (prefill)
        at least its own. A call of a chaining row bucket (``chain_rows``) only in another one (its rows carry
        chaining tables)."""
        if key.kind == "denoise":
            chain = key.rows in chain_rows
            return [key._replace(rows=R, width=W) for R in self.rows if R >= key.rows and (R in chain_rows or not chain)
                    for W in self.pages if W >= key.width]
        return [key._replace(rows=R, blocks=C) for C in self.prefill_blocks if C >= key.blocks
                for R in self.prefill_rows_for(C) if R >= key.rows]

    @classmethod
    def build(cls, *, max_rows: int, max_pages_per_row: int, max_prefill_blocks: int, fold_commit: bool,
              custom: dict | None = None) -> "ShapeBuckets":
        """The default buckets, with any of the four lists replaced by ``custom`` (``Engine(shape_buckets=...)``);
        a custom list whose largest bucket cannot hold what the engine's limits need is a ValueError."""
        need_rows = 2 * max_rows if fold_commit else max_rows  # folding adds up to one refresh row per request
        prefill_blocks = pow2_buckets(max_prefill_blocks)
        default = {"rows": pow2_buckets(need_rows), "pages": pow2_buckets(max_pages_per_row),
                   "prefill_blocks": prefill_blocks,
                   "prefill_rows": pow2_buckets(min(max_rows, prefill_blocks[-1]))}
        custom = dict(custom or {})
        unknown = sorted(set(custom) - set(default))
        if unknown:
            raise ValueError(f"shape_buckets: unknown key(s) {unknown}; valid: {sorted(default)}")
        values = {}
        for key, base in default.items():
            value = custom.get(key)
            if value is None:
                values[key] = base
                continue
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
                raise ValueError(f"shape_buckets.{key}: must be a non-empty list of integers >= 1, got {value!r}")
            values[key] = tuple(sorted(set(value)))
        needs = {"rows": (need_rows, "rows per denoise call" + (" (2 x max_running_requests with commit folding)"
                                                                 if fold_commit else "")),
                 "pages": (max_pages_per_row, "pages per row (context_length / block_size)")}
        for key, (need, what) in needs.items():
            if values[key][-1] < need:
                raise ValueError(f"shape_buckets.{key}: the largest bucket {values[key][-1]} cannot hold {need} {what}")
        if values["prefill_blocks"][-1] > prefill_blocks[-1]:
            raise ValueError(f"shape_buckets.prefill_blocks: the largest bucket {values['prefill_blocks'][-1]} exceeds "
                             f"the prefill budget of {prefill_blocks[-1]} blocks (max_prefill_tokens / block_size, "
                             f"at most a row's pages)")
        if values["prefill_rows"][0] != 1:
            raise ValueError(f"shape_buckets.prefill_rows: must include 1 (a single long prompt), got "
                             f"{values['prefill_rows']}")
        return cls(**values)


def variants_for(*, penalties: bool, logprobs: bool, top: bool, grammar: bool = False) -> int:
    return ((VARIANT_PENALTIES if penalties else 0) | (VARIANT_LOGPROBS if logprobs or top else 0)
            | (VARIANT_TOP if top else 0) | (VARIANT_GRAMMAR if grammar else 0))


def bucket_keys(buckets: ShapeBuckets, prefill_width: int, *, sampling: bool = False, logprobs: bool = False,
                penalties: bool = False, grammar: bool = False) -> list[tuple]:
    """Every key a call can take, with the step variants asked for (every combination: a batch may mix such
    requests). Prefill calls take the widest table (``prefill_width``)."""
    variants = [0]
    if penalties:
        variants += [VARIANT_PENALTIES]
    if grammar:
        variants += [v | VARIANT_GRAMMAR for v in list(variants)]
    if logprobs:
        variants += [v | VARIANT_LOGPROBS | top for v in list(variants) for top in (0, VARIANT_TOP)]
    out = [DenoiseKey("denoise", R, W, sampled, v) for sampled in ((False, True) if sampling else (False,))
           for v in variants for R, W in itertools.product(buckets.rows, buckets.pages)]
    out += [PrefillKey("prefill", R, C, prefill_width) for C in buckets.prefill_blocks for R in buckets.prefill_rows_for(C)]
    return out


# A staged warm-up compiles first a prefill bucket of at least this many tokens a row (a chat template and a
# question; a longer prompt prefills in several calls of it until its own bucket is compiled). Every call of the
# bucket costs its padded tokens' FLOPs: at 256 tokens (64 blocks of 4) an SDAR-1.7B-shaped model's first 13-token
# prompt took 30 s of a loaded 2-core CPU.
SHORT_PROMPT_TOKENS = 64


def staged_keys(keys: list[tuple], *, denoise_rows: int, block_size: int) -> tuple[list[tuple], list[tuple]]:
    """A staged warm-up's keys: those a single short chat needs, compiled before the engine is ready, and the rest,
    in the order common traffic reaches them (fewer rows, then narrower tables first; step variants last), left to
    the background thread.

    First: the plain denoise step at ``denoise_rows`` rows (one request, and its refresh row with commit folding) and
    the widest page table, and one prefill row of the smallest chunk that holds ``SHORT_PROMPT_TOKENS``. Until a
    narrower or a smaller bucket is compiled its calls run in these (:func:`fit_key`): the attention walks only a
    row's real prefix, so a wider table costs little; padded prefill blocks cost their FLOPs, once a prompt."""
    plain = [k for k in keys if k.kind == "denoise" and k.step_class == (False, 0)]
    prefills = [k for k in keys if k.kind == "prefill" and k.rows == 1]
    first = []
    if plain:
        rows = min((k.rows for k in plain if k.rows >= denoise_rows), default=max(k.rows for k in plain))
        first.append(max((k for k in plain if k.rows == rows), key=lambda k: k.width))
    if prefills:
        blocks = -(-SHORT_PROMPT_TOKENS // block_size)
        chunk = min((k.blocks for k in prefills if k.blocks >= blocks), default=max(k.blocks for k in prefills))
        first += [k for k in prefills if k.blocks == chunk]
    rest = sorted((k for k in keys if k not in first),
                  key=lambda k: (k.kind == "denoise" and k.step_class != (False, 0), k.rows, k[2]))
    return first, rest


def fit_key(compiler: "Compiler", key: tuple, larger: Callable[[], list[tuple]], ask: bool = True) -> tuple | None:
    """The key a call of ``key``'s shape runs under now: ``key`` itself unless it waits for a background compile;
    else (its compile asked for first, unless ``ask`` is False: a probe) the smallest compiled bucket among
    ``larger()`` (padding rows, a wider table, padded blocks: the same results), or None: the call waits."""
    if not compiler.compiles_in_background(key):
        return key
    if ask:
        compiler.compile_soon(key)
    ready = [k for k in larger() if not compiler.compiles_in_background(k)]
    return min(ready, key=lambda k: (k.rows * k[2], k)) if ready else None


def prefill_fit(compiler: "Compiler", buckets: ShapeBuckets, chunk: int, rows: int,
                width: int) -> tuple[int, int] | None:
    """(blocks per row, rows) a prefill call planned as ``rows`` rows of ``chunk`` blocks can run with now: as
    planned when its bucket or a larger one is compiled (:func:`fit_key`); while a staged warm-up compiles it,
    fewer blocks per row (the rest go in later calls), then fewer rows, in compiled buckets; None: nothing fits."""
    own = PrefillKey("prefill", pick_bucket(rows, buckets.prefill_rows_for(pick_bucket(chunk, buckets.prefill_blocks))),
                     pick_bucket(chunk, buckets.prefill_blocks), width)
    if fit_key(compiler, own, lambda: buckets.larger(own)) is not None:
        return chunk, rows
    for C in reversed([c for c in buckets.prefill_blocks if c < chunk]):
        for R in reversed(buckets.prefill_rows_for(C)):
            if not compiler.compiles_in_background(PrefillKey("prefill", R, C, width)):
                return C, min(R, rows)
    return None


# ----------------------------------------------------------------------------------------------
# The count of executables obtained (compiled, or loaded from the persistent cache)
# ----------------------------------------------------------------------------------------------
_STEP_FUNCTIONS = ("jit(denoise_packed)", "jit(prefill)", "jit(encode_chunk)", "jit(_denoise_loop)")
_compiles = [0]
_listening = threading.Lock()
_listener_installed = [False]


def _count_step_compile(event: str, duration_secs: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration" and kwargs.get("fun_name") in _STEP_FUNCTIONS:
        _compiles[0] += 1


def count_compiles() -> None:
    """Start counting the step functions' compiles (once per process; every :class:`Compiler` calls this, so
    importing the engine registers nothing with JAX)."""
    with _listening:
        if not _listener_installed[0]:
            jax.monitoring.register_event_duration_secs_listener(_count_step_compile)
            _listener_installed[0] = True


def compiled_executables() -> int:
    """How many executables the step functions have obtained in this process since counting began, compiled or
    loaded from the persistent cache (a test asserts it stops growing after warm-up). Counted from JAX's compile
    events, not from the jit dispatch caches: an executable compiled ahead of time enters those only at its first
    call."""
    return _compiles[0]


# ----------------------------------------------------------------------------------------------
# Which executables exist, warm-up, and compiling off the scheduler's thread
# ----------------------------------------------------------------------------------------------
class ProgressLines:
    """A warm-up's progress as log lines (for a log, where no progress bar draws): ``compiled 17/45 shape
    buckets``, one per tenth of the keys or per 5 s, whichever comes first. Called once per key compiled, from the
    compile pool's threads."""

    def __init__(self, total: int, log):
        self.total, self.log = total, log
        self.done = self.logged = 0
        self.at = time.perf_counter()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.done += 1
            now = time.perf_counter()
            if self.done < self.total and (self.done - self.logged >= max(1, self.total // 10) or now - self.at >= 5):
                self.logged, self.at = self.done, now
                self.log.info("compiled %d/%d shape buckets", self.done, self.total)


class Compiler:
    """The executables of one runner. ``lower(key)`` traces and lowers a key's call from abstract inputs (thread-
    safe: it touches no staging array or device buffer); its ``compile()`` puts the executable in JAX's caches,
    where the call of that shape finds it. ``background``: whether keys may compile on a thread of their own
    (single-process engines: with followers, every process must compile what the leader runs, in step).

    Background compiles run on one thread (the other cores keep serving), in order: a key a waiting call needs
    (:meth:`compile_soon`) goes before the keys a staged warm-up left for later (:meth:`compile_later`)."""

    def __init__(self, lower: Callable[[tuple], "jax.stages.Lowered"], *, background: bool = True):
        count_compiles()
        self.lower = lower
        self.background = background
        self.compiled: set[tuple] = set()
        self.warmed = False  # warm-up ran: a shape it did not cover compiles in the background (compile_soon)
        self.warmed_classes: set[tuple[bool, int]] = set()  # (sampling, variant) compiled for every bucket
        self._queue: list[tuple] = []  # keys the background thread compiles next, in order
        self._deferred: set[tuple] = set()  # keys a staged warm-up left to the background thread, not compiled yet
        self._current: tuple | None = None  # the key the background thread compiles now
        self._failed: dict[tuple, BaseException] = {}
        self._cv = threading.Condition()
        self._working = False  # the background thread runs (it ends when the queue is empty)
        self._thread: threading.Thread | None = None
        self._closed = False

    def warmup(self, keys: list[tuple], *, run: Callable[[tuple], None] | None = None, on_key=None,
               later: list[tuple] = ()) -> int:
        """Compile every key now. Returns the count. ``later``: keys of the same step classes left to the
        background thread (:meth:`compile_later`): a staged warm-up, ready once ``keys`` are.

        The executables are compiled ahead of time, not run: running a bucket of padding rows costs its full
        forward, and the big prefill buckets of a 50M model took minutes of a CPU's start that way. Tracing and
        lowering hold the GIL, compiling (or loading an executable from the persistent cache) mostly does not, so
        this thread lowers key after key while a pool of one thread per core compiles them: on a warm cache the
        loads hide behind the lowering. ``run`` (several processes): run each key's call instead (padding rows,
        writes to the trash page), so that every process compiles it now, in step, rather than inside a later
        collective."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                                   thread_name_prefix="dllm-compile") as pool:
            pending = []
            for key in keys:
                if run is not None:
                    run(key)
                    if on_key is not None:
                        on_key()
                    continue
                pending.append(pool.submit(self.lower(key).compile))
                if on_key is not None:
                    pending[-1].add_done_callback(lambda _: on_key())
            for future in pending:
                future.result()  # a compile error surfaces here, in the caller's thread
        with self._cv:
            self.compiled.update(keys)
        self.warmed = True
        self.warmed_classes.update(k.step_class for k in [*keys, *later] if k.kind == "denoise")
        if later:
            self.compile_later(later)
        return len(keys)

    def ran(self, key: tuple) -> None:
        """A call of ``key`` ran (it compiled in line if nothing had compiled it before)."""
        with self._cv:
            self.compiled.add(key)

    def compiles_in_background(self, key: tuple) -> bool:
        """Whether a call of ``key`` must wait for a background compile: its executable is not compiled yet and
        either a staged warm-up left it for later or its step variant was not warmed up. Only after a warm-up: an
        engine that compiles lazily compiles every call in line, as its first calls must anyway. A key whose
        background compile failed reads False: the call then runs and fails with the error (its requests only)."""
        if not self.background or not self.warmed_classes or key in self.compiled or key in self._failed:
            return False
        return key in self._deferred or (key.kind == "denoise" and key.step_class not in self.warmed_classes)

    def pending_keys(self) -> int:
        """How many keys the background thread has still to compile (a staged warm-up's rest included)."""
        with self._cv:
            return len(self._queue) + (self._current is not None)

    def compile_later(self, keys: list[tuple]) -> None:
        """Compile these keys on the background thread, in order, after any key a call waits for; until each is
        compiled, :meth:`compiles_in_background` reads True for it (its calls wait, or run in a larger compiled
        bucket)."""
        with self._cv:
            for key in keys if not self._closed else ():
                if key not in self.compiled and key not in self._deferred and key not in self._failed:
                    self._deferred.add(key)
                    self._queue.append(key)
            self._start()

    def compile_soon(self, key: tuple) -> None:
        """Compile ``key``'s executable on the background thread next (once; a no-op if compiled or under way):
        a call waits for it, so it goes before the keys a staged warm-up left for later."""
        with self._cv:
            if self._closed or key in self.compiled or key in self._failed or key == self._current:
                return
            if key in self._queue:
                self._queue.remove(key)
            self._deferred.add(key)
            self._queue.insert(0, key)
            self._start()

    def _start(self) -> None:
        """(Holding the lock.) Start the background thread if it is not running, and wake it."""
        if self._closed or not self._queue:
            return
        if not self._working:
            self._working = True
            self._thread = threading.Thread(target=self._work, name="dllm-compile-bg", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                if self._closed or not self._queue:
                    self._working = False
                    return
                key = self._current = self._queue.pop(0)
            try:
                if key not in self.compiled:
                    self._compile(key)
            except BaseException as e:  # the call that needs it runs and fails with it
                self._failed[key] = e
            finally:
                with self._cv:
                    self._deferred.discard(key)
                    self._current = None
                    self._cv.notify_all()

    def _compile(self, key: tuple) -> None:
        self.lower(key).compile()
        with self._cv:
            self.compiled.add(key)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a background compile finishes (the scheduler, with nothing it can
        run, waits here instead of spinning)."""
        with self._cv:
            if self._current is not None or self._queue:
                self._cv.wait(timeout)

    def close(self) -> None:
        """Compile nothing more in the background: drop the queue and wait for the key compiling (an engine shutting
        down: a compile left running aborts the interpreter at its exit). Keys left uncompiled stay waited for:
        calls keep running in the buckets compiled."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
