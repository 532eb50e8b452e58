"""Replacing a loaded model's parameters in place: named tensors (a checkpoint directory read one tensor at a time,
or arrays in memory) checked in full against the parameter table first, then placed leaf by leaf over the old ones.

Why in two phases: an update must be atomic for what can be checked (an unknown name, a wrong shape or dtype, a
missing tensor is a ``ValueError`` naming the tensor, raised before any leaf changes), while its memory must stay at
about one tensor beyond the model (no second copy of it): so the checks read only names, shapes and dtypes
(safetensors headers, array attributes), and the placement streams. Each new leaf gets the old leaf's placement (its
sharding on a mesh; uncommitted on one device, as the loader leaves it), so the compiled steps, whose parameters are
an argument, take the new buffers without compiling.

Names: a checkpoint name of the model's family (``model.layers.0.self_attn.q_proj.weight``, LLaDA2's fused
``query_key_value``, one tensor per expert; :func:`~dllm_jax.model.checkpoint_names.hf_tensor_parts`) or our pytree
path (``layers.0.qkv``, ``embed``; :func:`~dllm_jax.model.params.path_name`), stored as we store it: the same array
as the checkpoint's for every unfused tensor (matrices are ``[out, in]`` in both); a fused leaf by path is its
segments concatenated (one shard block's order, as ``dllm-jax convert`` writes it), and the unfused paths
(``layers.0.q``, ``layers.0.gate``) still name their segments. A segment is written into its rows of the fused
leaf, in place.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import gc
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.model.checkpoint_names import (COPIES, ID, Part, Unsupported, convert, expected_hf_shape,
                                             hf_tensor_parts, unconvert)
from dllm_jax.model.converted import CONVERTED_FORMAT, ORBAX_PARAMS_DIR, converted_format, converted_version
from dllm_jax.model.params import (Params, get_leaf, has_leaf, name_path, param_shapes, param_table, path_name,
                                   set_leaf)
from dllm_jax.model.fused import fused_groups, segment_alias, segment_of
from dllm_jax.model.placement import (_check_complete, _convert_fn, _copied, _normalize_head_device, _owned, _plan,
                                      _plan_ours, _Placer, missing_pieces, part_writer, segment_parts)
from dllm_jax.model.safetensors_io import (ST_DTYPES, HeaderError, SafetensorsFile, header_length, parse_header,
                                          safetensor_files)

ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}


def _host_platform() -> bool:
    return jax.devices()[0].platform == "cpu"


# ----------------------------------------------------------------------------------------------
# Names -> parts
# ----------------------------------------------------------------------------------------------
def resolve(cfg: ModelConfig, shapes: Params, name: str) -> tuple[list[Part], bool]:
    """The leaves tensor ``name`` fills (``[]``: a checkpoint name of a leaf this model does not have, e.g. the head
    of a tied model) and whether it is named by our pytree path. Raises ``ValueError`` for any other name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor {name!r}: a name must be a non-empty string")
    path = name_path(name)
    if has_leaf(shapes, path) and isinstance(get_leaf(shapes, path), tuple):
        leaf = param_table(cfg).leaf(path, cfg)
        if leaf.segments and fused_groups(cfg, leaf) > 1:  # named by path: a fused leaf on one block, as convert
            return segment_parts(cfg, leaf, path), True   # writes it: each segment goes to its blocks
        return [Part(path, None, ID)], True
    alias = segment_alias(cfg, path)
    if alias is not None:  # the unfused naming (``layers.0.q``): that segment of the fused leaf
        return [Part(alias[0], None, ID, alias[1])], True
    try:
        parts = hf_tensor_parts(cfg, name)
    except Unsupported as e:
        raise ValueError(f"tensor '{name}' {e}") from None
    if parts is None:
        raise ValueError(f"tensor '{name}': not a parameter of this model (neither a {cfg.family} checkpoint name "
                         f"nor a parameter path such as 'layers.0.q')")
    return [p for p in parts if has_leaf(shapes, p.path)], False


def _expected_shape(cfg: ModelConfig, shapes: Params, parts: list[Part], ours: bool) -> tuple:
    if ours and parts[0].segment is None:
        return tuple(get_leaf(shapes, parts[0].path))
    return tuple(expected_hf_shape(cfg, shapes, parts))


# ----------------------------------------------------------------------------------------------
# Arrays in memory
# ----------------------------------------------------------------------------------------------
def as_array(value, name: str):
    """A tensor as numpy or JAX (a CPU torch tensor, bfloat16 included, becomes numpy without a copy)."""
    if isinstance(value, (np.ndarray, jax.Array)):
        return value
    if type(value).__module__.split(".")[0] == "torch":
        if value.device.type != "cpu":
            raise ValueError(f"tensor '{name}': a torch tensor on {value.device}; move it to the CPU first")
        value = value.detach()
        if str(value.dtype) == "torch.bfloat16":
            import torch

            return value.contiguous().view(torch.int16).numpy().view(ST_DTYPES["BF16"])
        return value.numpy()
    try:
        return np.asarray(value)
    except Exception as e:
        raise ValueError(f"tensor '{name}': not an array ({type(value).__name__}: {e})") from None


@dataclasses.dataclass
class Planned:
    """One checked tensor: the leaves it fills, each leaf's dtype, and its value."""

    name: str
    parts: list[Part]
    targets: list
    value: Any
    ours: bool


def _named(named_tensors) -> list[tuple[str, Any]]:
    if isinstance(named_tensors, dict):
        return list(named_tensors.items())
    try:
        pairs = [tuple(item) for item in named_tensors]
    except TypeError:
        raise ValueError("named_tensors: expected a dict name -> array or a list of (name, array) pairs") from None
    for i, pair in enumerate(pairs):
        if len(pair) != 2:
            raise ValueError(f"named_tensors[{i}]: expected a (name, array) pair")
    return pairs


def plan_tensors(cfg: ModelConfig, params: Params, named_tensors) -> list[Planned]:
    """Check every tensor (name, shape, a floating dtype, no leaf filled twice) before any leaf changes; raises
    ``ValueError`` naming the first tensor at fault. Tensors of leaves the model does not have are dropped."""
    shapes = param_shapes(cfg)
    filled: dict[tuple, str] = {}
    out = []
    pairs = _named(named_tensors)
    if not pairs:
        raise ValueError("named_tensors: no tensors given")
    for name, value in pairs:
        parts, ours = resolve(cfg, shapes, name)
        value = as_array(value, name)
        if not parts:
            continue
        expected = _expected_shape(cfg, shapes, parts, ours)
        if tuple(value.shape) != expected:
            raise ValueError(f"tensor '{name}': shape {tuple(value.shape)}, expected {expected}")
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"tensor '{name}': dtype {value.dtype} is not a floating-point type")
        for part in parts:
            for key in _pieces(cfg, part):
                if key in filled:
                    what = path_name(part.path) + (f" (expert {part.expert})" if part.expert is not None else "")
                    raise ValueError(f"tensor '{name}': fills {what}, as tensor '{filled[key]}' does")
                filled[key] = name
        targets = [get_leaf(params, p.path).dtype for p in parts]
        out.append(Planned(name, parts, targets, value, ours))
    return out


def _pieces(cfg: ModelConfig, part: Part) -> list[tuple]:
    """What ``part`` writes, as (path, expert, segment) keys: a whole fused leaf writes each of its segments."""
    leaf = param_table(cfg).leaf(part.path, cfg)
    segments = [part.segment] if part.segment is not None or not leaf.segments else range(len(leaf.segments))
    return [(part.path, part.expert, j) for j in segments]


MAX_OPEN_BUFFERS = 2  # fused leaves being built on the host at once (an update's extra memory: about these)


def _host_copyable(t: Planned, part: Part, target) -> bool:
    """A host array of the leaf's dtype, a fused leaf's segment: copied into the leaf's host buffer on CPU."""
    return (part.segment is not None and part.expert is None and isinstance(t.value, np.ndarray)
            and t.value.dtype == np.dtype(target))


def _whole_on_host(cfg: ModelConfig, planned: list[Planned]) -> set[tuple]:
    """The fused leaves this update gives every segment of as host arrays of the leaf's dtype: on CPU each is built
    in a host buffer XLA adopts (one copy, as the loader does), not by donated writes of one segment at a time (a
    copy of the whole leaf per segment; with them the SDAR-1.7B shape's update from numpy took 3.48 s, 2.27 s now
    with this and :func:`~dllm_jax.model.placement._copied`)."""
    if not _host_platform():
        return set()
    shapes, keys = param_shapes(cfg), {}
    for t in planned:
        for part, target in zip(t.parts, t.targets):
            if _host_copyable(t, part, target):
                keys.setdefault(part.path, set()).add((None, part.segment))
    return {path for path, got in keys.items() if not missing_pieces(cfg, shapes, path, got)}


def apply_tensors(cfg: ModelConfig, params: Params, planned: list[Planned]) -> int:
    """Place checked tensors over their leaves, one tensor at a time (each waited for, so at most one new tensor is
    in flight). Returns the number of leaves written (a stacked expert leaf once)."""
    host = _host_platform()
    on_host = _whole_on_host(cfg, planned)
    builder = _Placer(cfg)  # the fused leaves being built on the host (its write_host / adopt, as the loader's)
    shapes = param_shapes(cfg)
    written: set[tuple] = set()
    for t in planned:
        value = t.value
        outputs = {}  # path -> its newest leaf (a fused leaf's earlier ones are donated to the later writes)
        for part, target in zip(t.parts, t.targets):
            old = get_leaf(params, part.path)
            placement = _Placement.of(old)
            if (part.path in on_host and part.path not in builder.host_stacks
                    and len(builder.host_stacks) >= MAX_OPEN_BUFFERS):
                on_host.discard(part.path)  # segments given far apart: this leaf by donated writes (bounded memory)
            if part.path in on_host and _host_copyable(t, part, target):
                builder.write_host(part, old.shape, value)
                written.add(part.path)
                if missing_pieces(cfg, shapes, part.path, builder.filled[part.path]):
                    continue
                builder.adopt(part.path)
                new = builder.stacks.pop(part.path)
            elif part.expert is not None or part.segment is not None:  # row e of a stacked leaf, a fused leaf's
                # segment: written in place (the old leaf is donated), rows copied into their blocks
                new = part_writer(cfg, part)(old, value, jnp.int32(part.expert or 0))
            elif part.convert[0] in COPIES and value.dtype == target:  # a copy of its own (the caller may reuse
                view = convert(part.convert, value)                        # its array): of the part's slice
                new = jnp.copy(view) if isinstance(view, jax.Array) else jax.device_put(
                    _copied(view) if host else np.ascontiguousarray(view))
            else:
                new = _convert_fn(part.convert, jnp.dtype(jnp.float32) if _norm_head(cfg, part, t.ours)
                                  else target)(value)
            if _norm_head(cfg, part, t.ours):
                new = _normalize_head_device(new, jnp.dtype(target))
            new = placement.put(new)
            set_leaf(params, part.path, new)
            outputs[part.path] = new
            written.add(part.path)
        jax.block_until_ready(list(outputs.values()))
        del old
        free_replaced()
    return len(written)


def free_replaced() -> None:
    """Free the leaves an update just replaced. JAX lets go of a host buffer it adopted (a CPU array made from numpy
    without a copy, as the loader's and the updates' leaves are) only when its own garbage collection runs, which any
    Python collection triggers (jax-ml/jax#14882); without this every replaced leaf stayed alive to the end of the
    update: 1.8 GiB more at the SDAR-1.7B shape, measured. A young-generation collection is enough and cheap."""
    gc.collect(0)


def _norm_head(cfg: ModelConfig, part: Part, ours: bool) -> bool:
    """A checkpoint's head of a ``norm_head`` model is normalised as the loader does (ours is stored normalised)."""
    return bool(cfg.norm_head) and not ours and part.path == ("lm_head",)


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where the old leaf lived: a new leaf must be placed alike, or the compiled steps would not take it (a
    committed array where the executables saw an uncommitted one compiles again, measured)."""

    sharding: Any
    committed: bool

    @classmethod
    def of(cls, leaf) -> "_Placement":
        return cls(leaf.sharding, bool(getattr(leaf, "committed", True)))

    def put(self, new):
        if self.committed:
            return new if new.sharding == self.sharding else jax.device_put(new, self.sharding)
        if getattr(new, "committed", False) or new.sharding != self.sharding:
            host = np.asarray(new)  # uncommitted again, through the host (a copy of one tensor)
            return jax.device_put(_owned(host) if _host_platform() else host)
        return new


# ----------------------------------------------------------------------------------------------
# A directory
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DirectoryPlan:
    """A checked directory: its open shards and the reads that load it (see :mod:`dllm_jax.model.placement`)."""

    files: list
    jobs: list
    ours: bool

    def close(self) -> None:
        for st in self.files:
            st.close()
        self.files = []


def plan_directory(cfg: ModelConfig, params: Params, model_dir: str) -> DirectoryPlan:
    """Open ``model_dir`` (a Hugging Face checkpoint of the model's family or a ``dllm-jax convert`` output) and
    check it from its headers alone: its config.json describes this model, every tensor's name and shape fit, and
    every leaf is covered. Raises ``ValueError`` naming the file or tensor."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"model_path: {model_dir}: not a directory")
    _check_config(cfg, model_dir)
    fmt = converted_format(model_dir)
    if fmt is not None and fmt != CONVERTED_FORMAT:
        raise ValueError(f"model_path: {model_dir} is an Orbax checkpoint ({fmt}), which is not read tensor by "
                         f"tensor; convert it again (dllm-jax convert writes safetensors) or give its HF source")
    ours = fmt == CONVERTED_FORMAT
    shard_dir = os.path.join(model_dir, ORBAX_PARAMS_DIR) if ours else model_dir
    paths = safetensor_files(shard_dir)
    if not paths:
        raise ValueError(f"model_path: {model_dir}: no safetensors files")
    files = [SafetensorsFile(path) for path in paths]
    try:
        shapes = param_shapes(cfg)
        dtypes = jax.tree.map(lambda x: x.dtype, params)
        plan = functools.partial(_plan_ours, version=converted_version(model_dir)) if ours else _plan
        jobs = [job for st in files for name, info in st.tensors.items()
                for job in plan(st, name, info, cfg, shapes, dtypes)]
        covered = param_table(cfg).empty(cfg)
        pieces: dict[tuple, set] = {}
        for job in jobs:
            for part in job.parts:
                if part.expert is None and part.segment is None:
                    set_leaf(covered, part.path, True)
                else:
                    pieces.setdefault(part.path, set()).add((part.expert, part.segment))
        for path, keys in pieces.items():
            if not missing_pieces(cfg, shapes, path, keys):
                set_leaf(covered, path, True)
        _check_complete(covered, shapes, cfg, model_dir, pieces, ours=ours)
    except BaseException:
        for st in files:
            st.close()
        raise
    return DirectoryPlan(files, jobs, ours)


def _check_config(cfg: ModelConfig, model_dir: str) -> None:
    """A directory with a config.json must describe the same parameters (names are read in its family's layout)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return
    other = ModelConfig.from_model_dir(model_dir)
    if other.family != cfg.family:
        raise ValueError(f"model_path: {model_dir}/config.json describes a {other.family} model; the engine serves "
                         f"a {cfg.family} model")
    theirs, ours = _flat_shapes(other), _flat_shapes(cfg)
    for name in sorted(set(theirs) | set(ours)):
        if theirs.get(name) != ours.get(name):
            raise ValueError(f"model_path: {model_dir}/config.json describes another model: parameter {name} is "
                             f"{theirs.get(name) or 'absent'} there, {ours.get(name) or 'absent'} in the engine")
    if bool(other.norm_head) != bool(cfg.norm_head):
        raise ValueError(f"model_path: {model_dir}/config.json: norm_head is {other.norm_head}, the engine's "
                         f"{cfg.norm_head}")


def _flat_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    return {path_name(path): leaf.shape_for(cfg) for path, leaf in param_table(cfg).paths(cfg)}


def apply_directory(cfg: ModelConfig, params: Params, plan: DirectoryPlan, mesh=None) -> int:
    """Stream a checked directory over the leaves: each tensor read from its mapped file, converted on the device
    and placed like the old leaf, which it then replaces (the loader's reads, :class:`_Placer`, with a few in
    flight); experts are written into their live stacked leaf in place. Returns the number of leaves written."""
    shapes = param_shapes(cfg)
    placer = _Placer(cfg, mesh)
    staged = param_table(cfg).empty(cfg)
    placements: dict[tuple, _Placement] = {}
    written = 0
    try:
        for k, job in enumerate(plan.jobs):
            if k + 1 < len(plan.jobs):
                plan.jobs[k + 1].prefetch()
            for part in job.parts:
                if part.path not in placements:  # read before an expert write donates the old stack
                    placements[part.path] = _Placement.of(get_leaf(params, part.path))
                if job.mode in ("expert", "fused") and part.path not in placer.stacks:
                    placer.stacks[part.path] = get_leaf(params, part.path)
                    placer.filled[part.path] = set()
            placer.place(job, shapes, staged)
            for path in {part.path for part in job.parts}:  # a stacked / fused leaf replaces the old one as soon
                if path in placer.host_stacks and not missing_pieces(cfg, shapes, path, placer.filled[path]):
                    placer.adopt(path)                       # as it is whole (not at the end: a second copy)
                if path in placer.stacks:  # the tree holds the newest stack, so the old leaf goes (free_replaced)
                    set_leaf(params, path, placer.stacks[path])
            for part in job.parts:
                if part.expert is None and has_leaf(staged, part.path):
                    new = get_leaf(staged, part.path)
                    del get_leaf(staged, part.path[:-1])[part.path[-1]]
                    if _norm_head(cfg, part, plan.ours):
                        new = _normalize_head_device(new, get_leaf(params, part.path).dtype)
                    set_leaf(params, part.path, placements[part.path].put(new))
                    written += 1
            free_replaced()
        placer.finish()
    finally:
        placer.in_flight.clear()
    for path, stack in placer.stacks.items():
        set_leaf(params, path, placements[path].put(stack))
        written += 1
    return written


# ----------------------------------------------------------------------------------------------
# Reading a weight back
# ----------------------------------------------------------------------------------------------
def plan_read(cfg: ModelConfig, name: str, truncate_size: int | None) -> list[Part]:
    """Check a ``get_weights_by_name`` request; the parts of leaves tensor ``name`` reads."""
    if truncate_size is not None and (not isinstance(truncate_size, int) or truncate_size < 0):
        raise ValueError(f"truncate_size: must be an integer >= 0 or None, got {truncate_size!r}")
    try:
        parts, _ = resolve(cfg, param_shapes(cfg), name)
    except ValueError as e:
        raise ValueError(f"name: {e}") from None
    if not parts:
        raise ValueError(f"name: tensor '{name}' is a {cfg.family} checkpoint name of a parameter this model does "
                         f"not hold (a tied head, an unused bias)")
    return parts


def read_weight(cfg: ModelConfig, params: Params, name: str, truncate_size: int | None = 100,
                fetch=np.asarray) -> np.ndarray:
    """Tensor ``name`` as float32 numpy (a copy) in the layout its name implies: a checkpoint name gives the
    checkpoint's layout (``[out, in]`` matrices, fused tensors fused), a path ours; only its first
    ``truncate_size`` rows (None: all), as SGLang's ``get_weights_by_name``. ``fetch``: a leaf -> its host value
    (a leaf sharded over several processes: gathered by all of them, :mod:`dllm_jax.engine.weight_sync`)."""
    parts = plan_read(cfg, name, truncate_size)
    pieces = []
    for part in parts:
        a = fetch(get_leaf(params, part.path))
        a = a[part.expert] if part.expert is not None else a
        if part.segment is not None:  # its rows, out of the fused leaf's blocks
            leaf = param_table(cfg).leaf(part.path, cfg)
            a = segment_of(cfg, leaf, a, part.segment, leaf.row_axis - (part.expert is not None))
        pieces.append(unconvert(part.convert, a))
    a = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1 if parts[0].convert[0] == "mid" else 0)
    return np.array(a if truncate_size is None else a[:truncate_size], dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# Tensors over HTTP: a safetensors blob, base64 in JSON (never pickle)
# ----------------------------------------------------------------------------------------------
def encode_tensors(named_tensors) -> str:
    """Named arrays (dict or pairs; numpy, JAX or CPU torch) as a base64 safetensors blob, the body field of
    ``POST /update_weights_from_tensor``."""
    pairs = [(name, np.ascontiguousarray(np.asarray(as_array(v, name)))) for name, v in _named(named_tensors)]
    header, offset = {}, 0
    for name, a in pairs:
        if a.dtype not in ST_NAMES:
            raise ValueError(f"tensor '{name}': dtype {a.dtype}; supported: {', '.join(ST_DTYPES)}")
        header[name] = {"dtype": ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    blob = len(head).to_bytes(8, "little") + head + b"".join(a.tobytes() for _, a in pairs)
    return base64.b64encode(blob).decode("ascii")


def decode_tensors(data: str, field: str = "serialized_named_tensors") -> dict[str, np.ndarray]:
    """A base64 safetensors blob -> name -> read-only numpy views on its bytes; ``ValueError`` naming ``field``
    or the tensor for anything malformed."""
    if not isinstance(data, str):
        raise ValueError(f"{field}: must be a base64 string")
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: not base64 (A-Z, a-z, 0-9, +, / and = padding)") from None
    try:
        n = header_length(blob[:8], len(blob))
        entries = parse_header(blob[8:8 + n], len(blob) - 8 - n)
    except HeaderError as e:
        raise ValueError(f"{field}: {e}") from None
    out = {name: np.frombuffer(blob, dtype, (end - begin) // dtype.itemsize, 8 + n + begin).reshape(shape)
           for name, (dtype, shape, begin, end) in entries.items()}
    if not out:
        raise ValueError(f"{field}: the blob holds no tensors")
    return out
