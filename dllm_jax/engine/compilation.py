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
    (single-process engines: with followers, every process must compile what the leader runs, in step)."""

    def __init__(self, lower: Callable[[tuple], "jax.stages.Lowered"], *, background: bool = True):
        count_compiles()
        self.lower = lower
        self.background = background
        self.compiled: set[tuple] = set()
        self.warmed = False  # warm-up ran: a shape it did not cover compiles in the background (compile_soon)
        self.warmed_classes: set[tuple[bool, int]] = set()  # (sampling, variant) compiled for every bucket
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self._failed: dict[tuple, BaseException] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def warmup(self, keys: list[tuple], *, run: Callable[[tuple], None] | None = None, on_key=None) -> int:
        """Compile every key now. Returns the count.

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
        self.compiled.update(keys)
        self.warmed = True
        self.warmed_classes.update(k.step_class for k in keys if k.kind == "denoise")
        return len(keys)

    def ran(self, key: tuple) -> None:
        """A call of ``key`` ran (it compiled in line if nothing had compiled it before)."""
        self.compiled.add(key)

    def compiles_in_background(self, key: tuple) -> bool:
        """Whether a call of ``key`` must wait for a background compile: its step variant was not warmed up and its
        executable is not compiled yet. Only after a warm-up: an engine that compiles lazily compiles every call in
        line, as its first calls must anyway. A key whose background compile failed reads False: the call then runs
        and fails with the error (its requests only)."""
        return (self.background and bool(self.warmed_classes) and key.kind == "denoise"
                and key not in self.compiled and key.step_class not in self.warmed_classes and key not in self._failed)

    def compile_soon(self, key: tuple) -> None:
        """Compile ``key``'s executable on the background thread (once; a no-op if compiled or under way). One
        thread: the other cores keep serving."""
        if key in self.compiled or key in self._compiling or key in self._failed:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dllm-compile")
        self._compiling[key] = self._pool.submit(self._compile, key)

    def _compile(self, key: tuple) -> None:
        try:
            self.lower(key).compile()
            self.compiled.add(key)
        except BaseException as e:  # the call that needs it runs and fails with it
            self._failed[key] = e
        finally:
            self._compiling.pop(key, None)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a background compile finishes (the scheduler, with nothing it can
        run, waits here instead of spinning)."""
        pending = list(self._compiling.values())
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
