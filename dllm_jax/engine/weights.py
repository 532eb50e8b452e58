"""In-place weight updates with SGLang's names (``update_weights_from_disk``, ``update_weights_from_tensor``,
``get_weights_by_name``, ``get_weight_version`` / ``update_weight_version``), for RL rollouts: new policy weights
reach a running engine without a restart (a cold start is tens of seconds) and without recompiling.

A mixin of :class:`dllm_jax.engine.engine.Engine`. What it guarantees, and why:

* **No recompilation.** The parameters are an argument of the compiled steps; each new leaf has the old leaf's
  shape, dtype and placement, so the executables take the new buffers (``compiled_executables`` does not move).
* **Atomic for what can be checked.** Names, shapes, dtypes (and, for a directory, its config.json and that every
  parameter is present) are checked before any leaf changes: a ``ValueError`` naming the tensor, old weights kept.
  A failure after that (an I/O or device error while placing) cannot be undone without a second copy of the model:
  it leaves some leaves new, and the version becomes ``"<version>+partial"`` so no answer claims either version.
* **About one tensor of extra memory**: tensors are placed one at a time over their leaves (a directory is read
  from its memory-mapped shards as the loader reads it, :mod:`dllm_jax.model.weight_update`).
* **Between rounds.** Leaves change under the engine's lock, which a scheduler round holds for its whole length,
  never during a device call. With ``flush_cache=True`` (the default) the update waits until no request holds KV
  pages (running requests finish, new ones queue meanwhile; ``abort_all_requests=True`` ends them first; paused
  ``retract`` / ``abort`` engines hold none), then empties the prefix cache, whose K/V came from the old weights.
  ``flush_cache=False`` updates at the next round boundary: running requests go on over their old K/V.
* **Versions.** ``weight_version`` (default ``EngineConfig.weight_version``, ``"default"``) names the loaded
  weights; every answer's ``meta_info["weight_version"]`` is the version loaded when its last block was decoded
  (a request in flight across an update, paused in place or retracted, mixed versions).

* **Every process.** A multi-process engine sends each update to its followers through the channel its device
  calls take, and every process updates its own shards (:mod:`dllm_jax.engine.weight_sync`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from dllm_jax.engine import weight_sync as ws
from dllm_jax.model import weight_update as wu

log = logging.getLogger("dllm_jax")

UPDATE_ABORT_MESSAGE = "aborted for a weight update (abort_all_requests)"


class WeightUpdates:
    weight_version: str = "default"
    _admission_holds = 0  # updates waiting for running requests to drain (admission is held while any does)
    _held_max_running = 0

    def update_weights_from_disk(self, model_path: str | os.PathLike, weight_version: str | None = None,
                                 flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """Load the weights of ``model_path`` (a checkpoint of this model's family, HF names, or a ``dllm-jax
        convert`` output) over the engine's, in place. ``weight_version``: the new version (None: unchanged, as
        SGLang). Returns ``{"success", "message", "weight_version", "num_parameters", "seconds"}``."""
        self._check_updatable("update_weights_from_disk", weight_version)
        start = time.perf_counter()
        plan = wu.plan_directory(self.config, self.runner.params, os.fspath(model_path))
        try:
            count = self._update(lambda params: ws.apply_directory_everywhere(self.runner, plan, model_path),
                                 weight_version, flush_cache, abort_all_requests)
        finally:
            plan.close()
        return self._updated(f"from {os.fspath(model_path)}", count, start, flush_cache)

    def update_weights_from_tensor(self, named_tensors, weight_version: str | None = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False) -> dict:
        """Replace the leaves ``named_tensors`` name (a dict name -> array or a list of (name, array); numpy, JAX or
        CPU torch arrays of a floating dtype, cast to the leaf's; names: this family's checkpoint names or our
        parameter paths such as ``layers.3.qkv``, or ``layers.3.q`` for its q rows). The others keep their values. Returns as
        :meth:`update_weights_from_disk`."""
        self._check_updatable("update_weights_from_tensor", weight_version)
        start = time.perf_counter()
        planned = wu.plan_tensors(self.config, self.runner.params, named_tensors)
        count = self._update(lambda params: ws.apply_tensors_everywhere(self.runner, planned), weight_version,
                             flush_cache, abort_all_requests)
        return self._updated(f"from {len(planned)} tensor(s)", count, start, flush_cache)

    def get_weights_by_name(self, name: str, truncate_size: int | None = 100):
        """The first ``truncate_size`` rows (None: all) of tensor ``name``, float32 numpy: a checkpoint name in the
        checkpoint's layout, a parameter path in ours (SGLang answers a list; ``.tolist()`` gives one)."""
        self._require_scheduler("get_weights_by_name")
        self._check_occupied("get_weights_by_name")
        with self._lock:
            return ws.read_everywhere(self.runner, name, truncate_size)

    def get_weight_version(self) -> str:
        return self.weight_version

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """Rename the loaded weights (after weights changed by other means); requests in flight then report it."""
        self._require_scheduler("update_weight_version")
        self._check_version(new_version, "new_version")
        with self._lock:
            if abort_all_requests:
                self._abort_in_flight(UPDATE_ABORT_MESSAGE)
            self._set_weight_version(new_version)
        return {"success": True, "message": f"weight version: {new_version}", "weight_version": new_version}

    # ------------------------------------------------------------------------------------------
    def _check_updatable(self, what: str, weight_version) -> None:
        self._require_scheduler(what)
        self._check_occupied(what)
        if self._shutdown:
            raise RuntimeError(f"{what}: the engine is shut down")
        if weight_version is not None:
            self._check_version(weight_version, "weight_version")

    @staticmethod
    def _check_version(version, field: str) -> None:
        if not isinstance(version, str) or not version:
            raise ValueError(f"{field}: must be a non-empty string, got {version!r}")

    def _set_weight_version(self, version: str) -> None:
        """Call with the lock held: requests in flight decode their next blocks with these weights."""
        self.weight_version = version
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            req.weight_version = version

    def _update(self, apply, weight_version, flush_cache: bool, abort_all_requests: bool) -> int:
        """Run ``apply(params)`` between rounds (see the module's doc), flush, set the version."""
        if abort_all_requests:
            with self._lock:
                self._abort_in_flight(UPDATE_ABORT_MESSAGE)
        with self._between_rounds(idle=flush_cache):
            try:
                count = apply(self.runner.params)
            except BaseException:
                self.weight_version = self.weight_version.removesuffix("+partial") + "+partial"
                log.error("a weight update failed after its checks: some leaves are new (weight_version %s)",
                          self.weight_version)
                raise
            finally:
                # the forwards' [in, out] copies follow now rather than at the next call, which would hold the old
                # leaves and their copies until then (dllm_jax.model.compute_layout)
                self.runner.compute.view(self.runner.params)
            if flush_cache:
                self.scheduler.policy.reset_cache()
            self._set_weight_version(weight_version if weight_version is not None else self.weight_version)
        self._wakeup.set()
        return count

    @contextlib.contextmanager
    def _between_rounds(self, idle: bool):
        """Hold the lock between two rounds; ``idle``: once no request holds KV pages (admission is held meanwhile,
        so that running requests drain; the caller's thread runs the rounds when no loop thread does)."""
        if not idle:
            with self._lock:
                yield
            return
        s = self.scheduler
        with self._lock:
            self._check_flush(error=ValueError)
            if not self._admission_holds:  # new and retracted requests stay queued meanwhile
                self._held_max_running, s.max_running = s.max_running, 0
            self._admission_holds += 1
        try:
            while True:
                with self._lock:
                    self._check_flush(error=ValueError)
                    if not s.running:
                        yield
                        return
                if self._thread is None:
                    self.step()
                else:
                    time.sleep(0.002)
        finally:
            with self._lock:
                self._admission_holds -= 1
                if not self._admission_holds:
                    s.max_running = self._held_max_running

    def _updated(self, source: str, count: int, start: float, flushed: bool) -> dict:
        seconds = time.perf_counter() - start
        message = (f"updated {count} parameter(s) {source} in {seconds:.3f} s; weight_version {self.weight_version}"
                   + ("; prefix cache flushed" if flushed else ""))
        log.info("%s", message)
        return {"success": True, "message": message, "weight_version": self.weight_version, "num_parameters": count,
                "seconds": seconds}
