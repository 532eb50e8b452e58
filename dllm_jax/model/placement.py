"""Streaming a checkpoint's tensors into device arrays: each tensor planned (which leaf, which conversion), read
from the memory-mapped file, copied (the leaf's bytes are the checkpoint's: matrices are stored ``[out, in]`` as the
checkpoints store them, a fused tensor is split by rows) or cast on the device, and placed with its sharding.

The plan of a checkpoint tensor comes from :mod:`dllm_jax.model.checkpoint_names` (published layouts) or from the
pytree path it is named by (a ``dllm-jax convert`` output). Peak memory is the model plus a few tensors in flight.
"""

from __future__ import annotations

import contextlib
import logging
import dataclasses
import functools
import mmap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.checkpoint_names import (CHUNKABLE, COPIES, ID, T, T3, Part, Unsupported, convert,
                                             expected_hf_shape, hf_name_for, hf_tensor_parts, part_shape,
                                             stored_shape)
from dllm_jax.model.converted import CONVERTED_VERSION, ORBAX_MARKER, ORBAX_PARAMS_DIR
from dllm_jax.model.errors import CheckpointError
from dllm_jax.model.fused import fused_groups, segment_alias, segment_blocks, segment_rows
from dllm_jax.model.params import (Params, get_leaf, has_leaf, key_path, name_path, param_dtypes, param_shapes,
                                   param_table, path_name, set_leaf)
from dllm_jax.model.safetensors_io import SafetensorsFile, TensorInfo, safetensor_files

log = logging.getLogger(__name__)

# A tensor that needs a conversion (transpose, split, cast) larger than this is converted in chunks of rows
# written into a donated output, so the conversion's temporary memory stays about this small.
CHUNK_BYTES = 64 << 20
# Conversions dispatched to the device before the loader waits for the oldest one: enough to keep the device
# busy while Python prepares the next tensor, few enough that the inputs in flight stay small.
MAX_IN_FLIGHT = 2
NORM_HEAD_EPS = 1e-7  # ``norm_head``: F.normalize's eps


def _anonymous(shape: tuple, dtype) -> np.ndarray:
    """Uninitialised page-aligned anonymous memory, which XLA:CPU adopts as a device buffer without a copy."""
    dtype = np.dtype(dtype)
    m = mmap.mmap(-1, max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1),
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(m, dtype, int(np.prod(shape, dtype=np.int64))).reshape(shape)


def _owned(view: np.ndarray) -> np.ndarray:
    """What to hand XLA:CPU for an array on the mapped file so that the device array is a copy, made once.

    XLA:CPU adopts a 64-byte aligned host array as is (``device_put``'s ``may_alias=False`` does not stop it) and
    copies any other. An unaligned contiguous view is therefore passed as it is (XLA copies it); an aligned one, or a
    strided one (a slice of a fused tensor's middle axis), is first copied into page-aligned anonymous memory, which
    XLA then adopts. Either way: one copy, none of the file aliased."""
    if view.ctypes.data % 64 and view.flags.c_contiguous:
        return view
    return _copied(view)


def _copied(view: np.ndarray) -> np.ndarray:
    """A copy in page-aligned anonymous memory, which XLA:CPU adopts. From a host array in memory (an update's
    tensors) faster than XLA's own copy of an unaligned one: 0.43 vs 0.54-0.84 s for a 594 MiB tensor, measured."""
    out = _anonymous(view.shape, view.dtype)
    np.copyto(out, view)
    return out


@functools.lru_cache(maxsize=None)
def _convert_fn(spec: tuple, dtype):
    """The jitted conversion ``spec`` then cast (one function per spec; jit caches per shape)."""
    return jax.jit(lambda a: convert(spec, a).astype(dtype))


@functools.lru_cache(maxsize=None)
def _update_fn(spec: tuple):
    """Write converted rows ``r0:`` of a chunked tensor into ``out`` in place (donated)."""
    def update(out, chunk, r0):
        value = convert(spec, chunk).astype(out.dtype)
        starts = [jnp.zeros((), jnp.int32)] * out.ndim
        starts[1 if spec[0] == "T" else 0] = r0
        return jax.lax.dynamic_update_slice(out, value, starts)
    return jax.jit(update, donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _write_fn(spec: tuple, expert: bool, blocks: tuple | None, row_axis: int):
    """Write a converted tensor into its leaf in place (donated): into row ``e`` of a stacked leaf (``expert``),
    and/or into a fused leaf's shard blocks (``blocks``: ``(leaf row, tensor row, count)`` along ``row_axis``,
    :func:`dllm_jax.model.fused.segment_blocks`). Each block is a copy of the tensor's rows."""
    def write(leaf, a, e):
        value = convert(spec, a).astype(leaf.dtype)
        value = value[None] if expert else value
        for dst, src, n in blocks or ((0, 0, value.shape[row_axis]),):
            starts = [jnp.zeros((), jnp.int32)] * leaf.ndim
            starts[0] = e if expert else starts[0]
            starts[row_axis] = jnp.int32(dst)
            piece = jax.lax.slice_in_dim(value, src, src + n, axis=row_axis)
            leaf = jax.lax.dynamic_update_slice(leaf, piece, starts)
        return leaf
    return jax.jit(write, donate_argnums=0)


def part_writer(cfg: ModelConfig, part: Part):
    """The in-place writer of an expert or segment part (see :func:`_write_fn`); called ``(leaf, tensor, e)``."""
    leaf = param_table(cfg).leaf(part.path, cfg)
    blocks = segment_blocks(cfg, leaf, part.segment) if part.segment is not None else None
    return _write_fn(part.convert, part.expert is not None, blocks, leaf.row_axis)


def copy_rows(cfg: ModelConfig, part: Part, buf: np.ndarray, host: np.ndarray) -> None:
    """Copy an expert's or a fused segment's rows of ``host`` (the tensor as stored) into the leaf's host buffer."""
    leaf = param_table(cfg).leaf(part.path, cfg)
    value = convert(part.convert, host)
    dst, axis = (buf[part.expert], leaf.row_axis - 1) if part.expert is not None else (buf, leaf.row_axis)
    blocks = segment_blocks(cfg, leaf, part.segment) if part.segment is not None else ((0, 0, value.shape[axis]),)
    index = lambda lo, n: (slice(None),) * axis + (slice(lo, lo + n),)  # noqa: E731
    for d, src, n in blocks:
        np.copyto(dst[index(d, n)], value[index(src, n)])


def missing_pieces(cfg: ModelConfig, shapes: Params, path: tuple, keys) -> list[tuple]:
    """The ``(expert, segment)`` pieces of leaf ``path`` that ``keys`` (the pieces written, None: all) leave
    unwritten: experts of a stacked leaf filled one tensor per expert, segments of a fused leaf."""
    leaf = param_table(cfg).leaf(path, cfg)
    per_expert = "{e}" in "".join(leaf.hf_names(cfg.family)) and not any(e is None for e, _ in keys)
    experts = range(get_leaf(shapes, path)[0]) if per_expert else [None]
    segments = range(len(leaf.segments)) if leaf.segments else [None]
    return [(e, j) for e in experts for j in segments
            if not any((ke is None or ke == e) and (kj is None or kj == j) for ke, kj in keys)]


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, static_argnums=1)
def _normalize_head_device(lm_head, dtype):
    """``norm_head``: each hidden unit's vocabulary vector of the ``[V, H]`` head L2-normalised (HF's
    ``F.normalize(lm_head.weight [V, H], dim=0, eps=1e-7)``, as SGLang / Bailing apply it at load); float32 in,
    ``dtype`` out."""
    a = lm_head.astype(jnp.float32)
    return (a / jnp.maximum(jnp.linalg.norm(a, axis=0, keepdims=True), NORM_HEAD_EPS)).astype(dtype)


@dataclasses.dataclass
class _Job:
    """One read: a whole tensor, or rows ``first_row : first_row + rows`` of it (a chunk of a large conversion)."""
    st: SafetensorsFile
    name: str
    info: TensorInfo
    parts: list  # the _Parts this tensor fills
    targets: list  # their storage dtypes
    mode: str  # "whole" (each part a slice of it, copied) | "convert" | "chunk" | "expert" | "fused" (on the device)
    first_row: int = 0
    rows: int | None = None  # None: all of it
    last: bool = True  # the tensor's last chunk

    @property
    def shape(self) -> tuple:
        return self.info.shape if self.rows is None else (self.rows,) + self.info.shape[1:]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.info.dtype.itemsize

    def view(self) -> np.ndarray:
        return self.st.view(self.name, self.first_row, self.rows)

    def prefetch(self) -> None:
        self.st.prefetch(self.name, self.first_row, self.rows)

    def release(self) -> None:
        self.st.release(self.name, self.first_row, self.rows)


class _Placer:
    """Turns jobs' mapped host arrays into device arrays of the target dtype (and sharding).

    * A tensor in the model's dtype (every tensor of a checkpoint loaded in its own dtype: matrices are stored as
      the checkpoint stores them) is copied from the mapping into its device buffer, each part of a fused tensor
      (LLaDA2's ``query_key_value``, a 3D ``gate_up_proj``) from its slice, never aliasing the file (XLA:CPU would
      adopt a 64-byte aligned mapping as is): a checkpoint rewritten while the engine runs must not change or
      crash it.
    * A tensor that needs a cast (or, from a converted directory of format version 1, a transpose) is converted on
      the device by a jitted function reading the mapping; above ``CHUNK_BYTES`` it goes in chunks of rows written
      into a donated output, so the extra memory is a chunk.
    * Expert matrices are written into their stacked ``[E, ...]`` leaf, and a fused leaf's segments (``q_proj`` into
      ``qkv``) into its shard blocks: on CPU without a cast, copied from the mapping into the leaf's host buffer,
      which XLA then adopts (one copy); else in place on the device (donated updates: copies of the tensor's rows).
    Each job's mapped range is released from the process once its device work is done, so peak memory is the
    model plus the few tensors in flight.
    """

    def __init__(self, cfg: ModelConfig, mesh=None):
        self.cfg = cfg
        self.mesh = mesh
        self.pending: dict[tuple, Any] = {}  # (chunked tensor, leaf) -> its output being filled
        self.stacks: dict[tuple, Any] = {}  # stacked expert / fused leaf path -> device array being filled
        self.host_stacks: dict[tuple, np.ndarray] = {}  # ... on CPU without a cast: its host buffer (write_host)
        self.filled: dict[tuple, set] = {}  # ... -> (expert, segment) pieces written so far
        self.in_flight: list[tuple[_Job, list]] = []  # dispatched jobs and the device arrays to wait for
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self.host_platform = device.platform == "cpu"  # device arrays live in host memory

    def sharding(self, path: tuple, shape: tuple):
        if self.mesh is None:
            return None
        from jax.sharding import NamedSharding

        from dllm_jax.model.params import param_axes
        from dllm_jax.sharding import spec_for

        return NamedSharding(self.mesh, spec_for(param_axes(self.cfg, path), shape, self.cfg, self.mesh))

    def place(self, job: _Job, shapes: Params, params: Params) -> None:
        host = job.view()
        outputs = []
        for part in job.parts if job.mode == "whole" else ():
            view = convert(part.convert, host)  # the tensor, or the part's slice of a fused one (a view)
            sharding = self.sharding(part.path, view.shape)
            if self.host_platform:  # one copy out of the mapped file, never an alias of it
                out = jax.device_put(_owned(view))
                out = out if sharding is None else jax.device_put(out, sharding)
            else:
                out = jax.device_put(np.ascontiguousarray(view), sharding)
            set_leaf(params, part.path, out)
            outputs.append(out)
        for part, target in zip(job.parts, job.targets) if job.mode != "whole" else ():
            leaf_shape = get_leaf(shapes, part.path)
            if job.mode in ("expert", "fused") and self.host_platform and host.dtype == np.dtype(target):
                self.write_host(part, leaf_shape, host)  # synchronous: nothing to wait for
                continue
            if job.mode in ("expert", "fused"):
                if part.path not in self.stacks:
                    self.stacks[part.path] = _zeros_fn(leaf_shape, target, self.sharding(part.path, leaf_shape))()
                    self.filled[part.path] = set()
                out = part_writer(self.cfg, part)(self.stacks[part.path], host, jnp.int32(part.expert or 0))
                self.stacks[part.path] = out
                self.filled[part.path].add((part.expert, part.segment))
            elif job.mode == "chunk":
                out = self.pending.pop((job.name, part.path), None)
                if out is None:
                    out = _zeros_fn(leaf_shape, target, self.sharding(part.path, leaf_shape))()
                out = _update_fn(part.convert)(out, host, jnp.int32(job.first_row))
                if job.last:
                    set_leaf(params, part.path, out)
                else:
                    self.pending[(job.name, part.path)] = out
            else:
                out = _convert_fn(part.convert, target)(host)
                sharding = self.sharding(part.path, leaf_shape)
                if sharding is not None:
                    out = jax.device_put(out, sharding)
                set_leaf(params, part.path, out)
            outputs.append(out)
        del host
        self.in_flight.append((job, outputs))
        while len(self.in_flight) > MAX_IN_FLIGHT:
            self.retire()

    def write_host(self, part: Part, leaf_shape: tuple, host: np.ndarray) -> None:
        """CPU, no cast: copy an expert's or a segment's rows from the mapped file straight into the leaf's host
        buffer (one copy; :meth:`finish` hands the filled buffer to XLA, which adopts it). On the device path
        (:func:`_write_fn`) the zero fill, the argument's transfer and the donated update cost three."""
        buf = self.host_stacks.get(part.path)
        if buf is None:
            buf = self.host_stacks[part.path] = _anonymous(leaf_shape, host.dtype)
            self.filled[part.path] = set()
        copy_rows(self.cfg, part, buf, host)
        self.filled[part.path].add((part.expert, part.segment))

    def retire(self) -> None:
        """Wait for the oldest dispatched job, then drop its mapped pages from the process."""
        job, outputs = self.in_flight.pop(0)
        for out in outputs:
            with contextlib.suppress(RuntimeError):  # donated away by a later update: that one is waited for
                out.block_until_ready()
        job.release()

    def adopt(self, path: tuple) -> None:
        """Hand a filled host buffer to XLA (adopted as is: page-aligned), placed if sharded, as ``stacks[path]``."""
        buf = self.host_stacks.pop(path)
        out = jax.device_put(buf)
        sharding = self.sharding(path, buf.shape)
        self.stacks[path] = out if sharding is None else jax.device_put(out, sharding)

    def finish(self) -> None:
        while self.in_flight:
            self.retire()
        for path in list(self.host_stacks):
            self.adopt(path)


def load_safetensors_params(model_dir: str, cfg: ModelConfig, dtype, *, progress: bool = False,
                            mesh=None, ours: bool = False, ours_version: int = CONVERTED_VERSION) -> Params:
    """Stream the checkpoint's tensors into device arrays of ``dtype`` (routing leaves: float32, see the table).

    Shards are memory-mapped and read one tensor at a time (see :class:`_Placer`): no float32 host copy, no second
    copy of the model; the process's peak memory is the model plus a few tensors. With ``mesh`` each leaf is
    placed with its :mod:`dllm_jax.sharding` layout as it is loaded. ``progress`` shows a bar (bytes read).
    ``ours``: the shards of a converted directory (``dllm-jax convert``), named and laid out as our pytree (format
    ``ours_version``: :func:`dllm_jax.model.converted.converted_version`).
    """
    from tqdm import tqdm

    shapes = param_shapes(cfg)
    dtypes = param_dtypes(cfg, dtype)
    params: Params = param_table(cfg).empty(cfg)
    placer = _Placer(cfg, mesh)
    paths = safetensor_files(model_dir)
    if not paths:
        raise CheckpointError(f"{model_dir}: no model.safetensors or safetensors index found (nor a converted "
                              f"'{ORBAX_PARAMS_DIR}/' with its {ORBAX_MARKER})")
    files = [SafetensorsFile(path) for path in paths]  # every header first: fail early
    try:
        plan = functools.partial(_plan_ours, version=ours_version) if ours else _plan
        jobs = [job for st in files for name, info in st.tensors.items()
                for job in plan(st, name, info, cfg, shapes, dtypes)]
        _log_skipped_vision(files, cfg)
        total = sum(info.nbytes for st in files for info in st.tensors.values())
        with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=not progress,
                  leave=False) as bar:
            for k, job in enumerate(jobs):
                if k + 1 < len(jobs):
                    jobs[k + 1].prefetch()
                placer.place(job, shapes, params)
                bar.update(job.nbytes)
            placer.finish()
            bar.update(total - bar.n)  # tensors the model does not use (rotary buffers, a tied lm_head)
    finally:
        placer.in_flight.clear()
        for st in files:
            st.close()
    for leaf_path, stack in placer.stacks.items():
        if not missing_pieces(cfg, shapes, leaf_path, placer.filled[leaf_path]):
            set_leaf(params, leaf_path, stack)
    if cfg.norm_head and "lm_head" in params and not ours:  # a converted head is stored normalised
        params["lm_head"] = _normalize_head_device(params["lm_head"], jnp.dtype(get_leaf(dtypes, ("lm_head",))))
    _check_complete(params, shapes, cfg, model_dir, placer.filled, ours=ours)
    return params


def _log_skipped_vision(files, cfg: ModelConfig) -> None:
    """One line for the vision tower a multimodal checkpoint carries (not in the text model's pytree; the engine
    loads it apart, :mod:`dllm_jax.model.vision_params`)."""
    from dllm_jax.model.gemma_params import LAYOUT, VISION_PREFIXES

    if cfg.family != LAYOUT:
        return
    vision = [info.nbytes for st in files for name, info in st.tensors.items() if name.startswith(VISION_PREFIXES)]
    if vision:
        log.info("the vision tower: %d tensors, %.1f MB, not in the text model's weights", len(vision),
                 sum(vision) / 1e6)


def _plan(st: SafetensorsFile, name: str, info: TensorInfo, cfg: ModelConfig, shapes: Params,
          dtypes: Params) -> list[_Job]:
    """The reads that load tensor ``name`` (none if the model does not use it); shape errors surface here."""
    path = st.path
    try:
        parts = hf_tensor_parts(cfg, name)
    except Unsupported as e:
        raise CheckpointError(f"{path}: tensor '{name}' {e}") from None
    parts = [p for p in parts or () if has_leaf(shapes, p.path)]
    if not parts:  # not a weight (rotary buffers), a tied lm_head, or biases the config does not use
        return []
    expected = expected_hf_shape(cfg, shapes, parts)
    if info.shape != expected:
        raise CheckpointError(f"{path}: tensor '{name}' has shape {info.shape}, expected {expected} "
                              f"from config.json")
    targets = []
    for part in parts:
        target = jnp.dtype(get_leaf(dtypes, part.path))
        if part.path == ("lm_head",) and cfg.norm_head:
            target = jnp.dtype(jnp.float32)  # normalised in float32 after loading, then cast
        if part.expert is not None and part.expert >= get_leaf(shapes, part.path)[0]:
            raise CheckpointError(f"{path}: tensor '{name}' is for expert {part.expert} but the config has "
                                  f"num_experts={get_leaf(shapes, part.path)[0]}")
        targets.append(target)
    if parts[0].expert is not None:
        return [_Job(st, name, info, parts, targets, "expert")]
    if any(p.segment is not None for p in parts):
        return [_Job(st, name, info, parts, targets, "fused")]
    return _jobs(st, name, info, parts, targets)


def _plan_ours(st: SafetensorsFile, name: str, info: TensorInfo, cfg: ModelConfig, shapes: Params,
               dtypes: Params, version: int = CONVERTED_VERSION) -> list[_Job]:
    """Jobs for a tensor of a converted directory: named by its pytree path (``layers.3.moe.gate_up``), stored in
    our layout on one shard block, so it is used as stored (a dtype cast at most); on more shard blocks a fused
    leaf's segments go to their blocks. Format 2 stored q / k / v and gate / up apart (``layers.3.q``): each is
    its segment of the fused leaf. ``version`` 1 directories stored matrices ``[in, out]``: those are transposed
    on the way in."""
    path = name_path(name)
    alias = segment_alias(cfg, path) if version < 3 else None
    if alias is None and (not has_leaf(shapes, path) or not isinstance(get_leaf(shapes, path), tuple)):
        raise CheckpointError(f"{st.path}: tensor '{name}' is not a parameter of the model config.json describes")
    leaf_path = alias[0] if alias else path
    leaf = param_table(cfg).leaf(leaf_path, cfg)
    spec = ID
    if version < 2 and leaf.matrix:
        spec = T3 if len(get_leaf(shapes, leaf_path)) == 3 else T
    if alias:
        parts = [Part(leaf_path, None, spec, alias[1])]
    elif leaf.segments and fused_groups(cfg, leaf) > 1:  # stored on one block: each segment to its blocks
        parts = segment_parts(cfg, leaf, path)
    else:
        parts = [Part(path, None, spec)]
    expected = stored_shape(spec, tuple(get_leaf(shapes, leaf_path)) if not alias else
                            part_shape(cfg, shapes, parts[0]))
    if info.shape != expected:
        raise CheckpointError(f"{st.path}: tensor '{name}' has shape {info.shape}, expected {expected} from "
                              f"config.json")
    targets = [jnp.dtype(get_leaf(dtypes, leaf_path))] * len(parts)
    if any(p.segment is not None for p in parts):
        return [_Job(st, name, info, parts, targets, "fused")]
    return _jobs(st, name, info, parts, targets)


def segment_parts(cfg: ModelConfig, leaf, path: tuple) -> list[Part]:
    """A fused leaf given in one block's row order (its segments concatenated, as ``dllm-jax convert`` writes it)
    as its segments' parts, each to its blocks."""
    kind, lo, parts = "mid" if leaf.row_axis else "rows", 0, []
    for j in range(len(leaf.segments)):
        parts.append(Part(path, None, (kind, lo, lo + segment_rows(cfg, leaf, j)), j))
        lo += segment_rows(cfg, leaf, j)
    return parts


def _jobs(st: SafetensorsFile, name: str, info: TensorInfo, parts: list[Part], targets: list) -> list[_Job]:
    """A tensor in its leaves' dtype is copied (a fused one part by part, each from its slice); one that needs a
    conversion is converted whole, or above ``CHUNK_BYTES`` in chunks of rows (when every part's conversion acts row
    by row)."""
    if all(p.convert[0] in COPIES for p in parts) and all(info.dtype == t for t in targets):
        return [_Job(st, name, info, parts, targets, "whole")]
    rows = info.shape[0] if info.shape else 1
    if info.nbytes <= CHUNK_BYTES or rows < 2 or any(p.convert[0] not in CHUNKABLE for p in parts):
        return [_Job(st, name, info, parts, targets, "convert")]
    per_chunk = max(1, CHUNK_BYTES // (info.nbytes // rows))
    return [_Job(st, name, info, parts, targets, "chunk", r0, min(per_chunk, rows - r0), r0 + per_chunk >= rows)
            for r0 in range(0, rows, per_chunk)]


def _check_complete(params: Params, shapes: Params, cfg: ModelConfig, model_dir: str,
                    pieces: dict | None = None, ours: bool = False) -> None:
    """Raise naming the tensors no leaf got (``pieces``: the (expert, segment) pieces written into each stacked or
    fused leaf that is not complete)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    names: list[str] = []
    for tree_path, shape in flat:
        path = key_path(tree_path)
        if has_leaf(params, path):
            continue
        if ours:
            names.append(path_name(path))
            continue
        for e, j in missing_pieces(cfg, shapes, path, (pieces or {}).get(path, set())):
            names.append(hf_name_for(cfg, path, e if e is not None else None, j))
    names = list(dict.fromkeys(names))  # fused q/k/v name once
    if names:
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensors: {', '.join(names[:8])}"
                              + (" ..." if len(names) > 8 else ""))
