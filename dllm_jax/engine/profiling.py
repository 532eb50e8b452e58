"""JAX profiler traces of the engine's steps (``Engine.start_profile`` / ``stop_profile``, ``/start_profile``):
a perfetto trace of the next ``num_steps`` rounds, or until stopped.

:class:`Profiling` is a part of :class:`dllm_jax.Engine` (the loop counts its rounds in ``_steps`` and stops the
trace when the count is reached).
"""

from __future__ import annotations

import os

import jax


class Profiling:
    def start_profile(self, profile_dir: str | None = None, num_steps: int | None = None) -> str:
        """Start a JAX profiler trace (perfetto) into ``profile_dir``; it stops after ``num_steps`` rounds
        (default: the engine's ``profile_steps``; 0 = until :meth:`stop_profile`)."""
        directory = os.path.abspath(profile_dir or self._profile_dir or "dllm_profile")
        with self._profile_lock:
            if self._profiling:
                raise RuntimeError("a profile is already being recorded")
            os.makedirs(directory, exist_ok=True)
            jax.profiler.start_trace(directory, create_perfetto_trace=True)
            self._profiling = True
            self._profile_current = directory
            steps = self._profile_steps if num_steps is None else num_steps
            self._profile_steps = steps
            self._profile_stop_at = self._steps + steps
            return directory

    def stop_profile(self) -> str | None:
        with self._profile_lock:  # the loop's automatic stop and an explicit one may race
            if not self._profiling:
                return None
            jax.profiler.stop_trace()
            self._profiling = False
            return self._profile_current
