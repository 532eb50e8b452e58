"""How many KV pages the engine allocates: a share of the memory left once the weights are placed.

``mem_fraction`` (``Engine(mem_fraction=...)``, ``--mem-fraction``) is the share of the *free* memory given to the
KV page pool: on a GPU, the device's free memory (``bytes_limit - bytes_in_use`` after the weights are on it); on
CPU, the host's available memory (``MemAvailable`` of ``/proc/meminfo``, or the cgroup's remaining limit when
that is smaller), measured after the weights are loaded. The rest stays free for activations, compiled programs
and the host side. Defaults: 0.85 on GPU, 0.25 on CPU (the host also runs the Python side, and a developer's
machine runs other programs).

The pool never exceeds what can be used: every running row at full context, twice over (the second half can
only hold prefix-cache pages), so a small model on a large machine does not zero gigabytes for nothing. A budget
too small for one request at ``context_length`` is a ``ValueError`` at startup, naming the numbers and the flags
that change them. An explicit ``num_kv_pages`` bypasses all of this.

The pool's page count is a dimension of every compiled program, and free memory moves by a few percent between
two starts; so the size chosen is remembered (a small JSON file beside the persistent compilation cache, keyed by
the page size and the flags), and a later start reuses it while it stays within ``REUSE_TOLERANCE`` of what the
fraction gives now. Without that, a second start of the same server compiled every bucket again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile

DEFAULT_MEM_FRACTION = {"gpu": 0.85, "cpu": 0.25}
REUSE_TOLERANCE = 0.10  # a remembered pool size is reused within +-10% of the fresh budget...
MAX_SHARE_ON_REUSE = 0.90  # ...but never more than this share of the free memory (a GPU's 0.85 leaves little room)


@dataclasses.dataclass(frozen=True)
class KVBudget:
    num_pages: int  # pages in the pool, page 0 (the trash page of padding rows) included
    page_bytes: int
    block_size: int
    source: str  # how the size was chosen, for the startup line
    free_bytes: int | None = None  # the memory the fraction was taken of (None: explicit num_kv_pages)
    mem_fraction: float | None = None

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def tokens(self) -> int:
        return self.usable_pages * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def describe(self, context_length: int) -> str:
        """The startup line: pages, tokens of context, memory, and how many requests fit at full context."""
        rows = self.usable_pages // math.ceil(context_length / self.block_size)
        return (f"KV pool: {self.usable_pages:,} pages of {self.block_size} tokens = {self.tokens:,} tokens of "
                f"context ({human(self.pool_bytes)}; {self.source}); {rows:,} request"
                f"{'' if rows == 1 else 's'} at the full context of {context_length:,} tokens")


def human(n: float) -> str:
    """Bytes as a short human figure (3 significant digits): 512 B, 1.25 MiB, 3.20 GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def available_memory(device) -> tuple[int, str]:
    """Free bytes for the KV pool on ``device`` (after whatever is placed now) and what they are."""
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), f"free memory of {device.device_kind}"
    return host_available_memory(), "available host memory"


def host_available_memory() -> int:
    """``MemAvailable`` (Linux), bounded by the cgroup v2 limit's remainder when one is set."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 << 30
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read().strip())
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return int(avail)


def plan_kv_pool(*, page_bytes: int, block_size: int, context_length: int, max_running_requests: int,
                 mem_fraction: float | None, device, num_kv_pages: int | None = None,
                 free_bytes: int | None = None, remember: str | None = None) -> KVBudget:
    """Choose the pool size (see the module docstring). ``free_bytes`` overrides the measurement (tests);
    ``remember`` is the JSON file that keeps the size chosen at the last start (None: nothing remembered)."""
    if num_kv_pages is not None:
        if not isinstance(num_kv_pages, int) or isinstance(num_kv_pages, bool) or num_kv_pages < 2:
            raise ValueError(f"num_kv_pages: must be an integer >= 2 (page 0 is reserved), got {num_kv_pages!r}")
        return KVBudget(num_kv_pages, page_bytes, block_size, "num_kv_pages given")
    platform = "cpu" if device.platform == "cpu" else "gpu"
    if mem_fraction is None:
        mem_fraction = DEFAULT_MEM_FRACTION[platform]
    if not isinstance(mem_fraction, (int, float)) or isinstance(mem_fraction, bool) or not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction: must be in (0, 1], got {mem_fraction!r}")
    what = "free memory" if free_bytes is not None else None
    if free_bytes is None:
        free_bytes, what = available_memory(device)
    pages_per_row = math.ceil(context_length / block_size)
    budget_pages = int(mem_fraction * free_bytes // page_bytes)
    need = pages_per_row + 1
    if budget_pages < need:
        raise ValueError(
            f"mem_fraction: {mem_fraction:g} of the {human(free_bytes)} of {what} left after the weights "
            f"holds {max(budget_pages - 1, 0):,} KV pages ({human(page_bytes)} each); one request at "
            f"context_length {context_length:,} needs {pages_per_row:,} pages + 1 reserved "
            f"({human(need * page_bytes)}). Raise --mem-fraction, lower --context-length, use a smaller "
            f"dtype, or give --num-kv-pages explicitly")
    cap = 2 * max_running_requests * pages_per_row + 1
    num = min(budget_pages, cap)
    source = f"mem_fraction {mem_fraction:g} of {human(free_bytes)} {what}"
    if num == cap and budget_pages > cap:
        source += f", capped at 2 x {max_running_requests} rows x full context"
    if remember is not None:
        key = (f"{device.platform}/{getattr(device, 'device_kind', '')}/page {page_bytes}/block {block_size}/"
               f"context {context_length}/rows {max_running_requests}/fraction {mem_fraction:g}")
        sizes = _read_sizes(remember)
        last = sizes.get(key)
        share = min(mem_fraction * (1 + REUSE_TOLERANCE), max(mem_fraction, MAX_SHARE_ON_REUSE))
        if (isinstance(last, int) and last != num and need <= last <= cap
                and num * (1 - REUSE_TOLERANCE) <= last <= share * free_bytes // page_bytes):
            num = last
            source += "; kept at the last start's size so its compiled programs are reused"
        elif last != num:
            _write_sizes(remember, {**sizes, key: num})
    return KVBudget(num, page_bytes, block_size, source, free_bytes, float(mem_fraction))


def _read_sizes(path: str) -> dict:
    try:
        with open(path) as f:
            sizes = json.load(f)
        return sizes if isinstance(sizes, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_sizes(path: str, sizes: dict) -> None:
    """Atomically (two servers may start at once); a read-only cache directory just means nothing is kept."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".kv_pool-")
        with os.fdopen(fd, "w") as f:
            json.dump(sizes, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
