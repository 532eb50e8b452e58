"""The persistent compilation cache: compiled executables on disk, so a second start skips the compiles.

Every shape bucket is one XLA executable; compiling them is most of a cold start. JAX can keep executables in a
directory keyed by the program, the compiler flags and the JAX version, so a later process with the same model,
buckets and flags loads them instead of compiling (a stale entry is never used: a different program has a
different key).

Where: ``compilation_cache`` argument (``Engine(compilation_cache=...)``, ``--compilation-cache DIR``), else
``$DLLM_JAX_COMPILATION_CACHE``, else ``$XDG_CACHE_HOME/dllm-jax/xla`` (``~/.cache/dllm-jax/xla``). The values
``off`` / ``none`` / ``0`` / ``false`` disable it. When JAX's own ``jax_compilation_cache_dir`` is already set (by
the user, before the engine), that directory is kept. The setting is process-wide (it is JAX's).

The cache is trusted code: do not point it at a directory others can write to.
"""

from __future__ import annotations

import os

ENV = "DLLM_JAX_COMPILATION_CACHE"
DISABLED = ("off", "none", "0", "false", "no")


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dllm-jax", "xla")


def resolve(setting: str | None = None) -> str | None:
    """The directory a setting means (None: the environment or the default), or None when disabled."""
    value = setting if setting is not None else os.environ.get(ENV)
    if value is None:
        return default_dir()
    value = str(value).strip()
    if value.lower() in DISABLED or not value:
        return None
    return os.path.abspath(os.path.expanduser(value))


def enable(setting: str | None = None) -> str | None:
    """Point JAX's persistent cache at the resolved directory and cache every executable (even ones that
    compile in well under a second: a cold start is made of many such). Returns the directory in use, or None."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current and setting is None and os.environ.get(ENV) is None:
        return current  # the user configured JAX directly: keep it
    path = resolve(setting)
    if path is None:
        if current:
            jax.config.update("jax_compilation_cache_dir", None)
            _reset()
        return None
    if path == current:
        return path
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache: cannot create {path}: {e}") from e
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if current:
        _reset()
    return path


def _reset() -> None:
    """Make JAX re-read the cache directory (it initialises its cache once per directory)."""
    from jax._src import compilation_cache

    compilation_cache.reset_cache()


def beside(cache_dir: str | None, name: str) -> str | None:
    """A file of ours kept in the cache directory (e.g. the KV pool size its programs were compiled for), or
    None when the cache is off or not a local directory."""
    if not cache_dir or not os.path.isdir(cache_dir):
        return None
    return os.path.join(cache_dir, name)
