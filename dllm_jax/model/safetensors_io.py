"""Safetensors files: a memory-mapped reader (tensor by tensor, pages released as they are consumed) and a writer
(tensor by tensor, sharded in the Hugging Face naming with its ``model.safetensors.index.json``).

Every failure names the file or tensor at fault: a user with a broken checkpoint should not have to read a stack
trace to find which shard is truncated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import re

import ml_dtypes  # ships with jax: bfloat16 as a numpy dtype
import numpy as np

from dllm_jax.model.errors import CheckpointError

BF16 = np.dtype(ml_dtypes.bfloat16)
# Source dtypes a checkpoint may store (little-endian, as the format prescribes).
ST_DTYPES = {"BF16": BF16, "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64)}
INDEX_FILE = "model.safetensors.index.json"


def safetensor_files(model_dir: str) -> list[str]:
    """The directory's safetensors shards: those its index names, else ``model.safetensors``, else every
    ``*.safetensors`` file; ``[]`` when it has none."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(model_dir, fn)):
                raise CheckpointError(f"{os.path.join(model_dir, fn)}: shard named in {index} is missing")
        return [os.path.join(model_dir, fn) for fn in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if found:
        return [os.path.join(model_dir, f) for f in found]
    return []


MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit (a header is names, shapes and offsets)
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.:/\-]{1,128}")


class HeaderError(ValueError):
    """A malformed safetensors header; the message says what is wrong without quoting the file's bytes."""


def header_length(head: bytes, size: int) -> int:
    """The JSON header's length from a file's (or blob's) first 8 bytes, ``size`` bytes in all; a
    :class:`HeaderError` that does not quote those bytes (a file that is not a safetensors file must not have its
    first bytes read back to whoever named it)."""
    if len(head) < 8:
        raise HeaderError("not a safetensors file (shorter than its 8-byte header length)")
    n = int.from_bytes(head[:8], "little")
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise HeaderError("not a safetensors file (its first 8 bytes are not the length of a header that fits it; "
                          "truncated, or another kind of file)")
    return n


def parse_header(raw: bytes, data_size: int, *, names: bool = True) -> dict[str, tuple[np.dtype, tuple, int, int]]:
    """A safetensors JSON header -> name -> (dtype, shape, begin, end), checked in full against the ``data_size``
    bytes that follow it: every entry an object with a supported ``dtype``, a ``shape`` of non-negative integers
    and ``data_offsets`` ``[begin, end]`` with ``0 <= begin <= end <= data_size`` holding exactly that shape. A
    :class:`HeaderError` otherwise, naming the entry by position and, when ``names`` and the name is a plain
    tensor name, by name (never quoting the header's other contents)."""
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise HeaderError("the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise HeaderError("the header is not a JSON object")
    out = {}
    for k, (name, meta) in enumerate(header.items()):
        if name == "__metadata__":
            continue
        entry = f"header entry {k}" + (f" (tensor '{name}')" if names and _SAFE_NAME.fullmatch(name) else "")
        if not isinstance(meta, dict):
            raise HeaderError(f"{entry}: not an object")
        dtype_name, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if not isinstance(dtype_name, str) or dtype_name not in ST_DTYPES:
            raise HeaderError(f"{entry}: dtype must be one of {', '.join(ST_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape) or len(shape) > 64:
            raise HeaderError(f"{entry}: shape must be a list of at most 64 non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
            raise HeaderError(f"{entry}: data_offsets must be two non-negative integers [begin, end]")
        begin, end = offsets
        if not begin <= end <= data_size:
            raise HeaderError(f"{entry}: data_offsets [{begin}, {end}] do not lie within the {data_size} data bytes")
        dtype = ST_DTYPES[dtype_name]
        count = 1
        for d in shape:  # exact (Python integers): a product that wraps around int64 must not pass
            count *= d
        if count * dtype.itemsize != end - begin:
            raise HeaderError(f"{entry}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape "
                              f"{tuple(shape)} of {dtype_name} needs {count * dtype.itemsize}")
        out[name] = (dtype, tuple(shape), begin, end)
    return out


def _is_count(v) -> bool:
    return type(v) is int and 0 <= v < 1 << 62  # (not bool, not 2.0, not Infinity)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: np.dtype
    shape: tuple
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped read-only and read tensor by tensor.

    The format is 8 bytes of little-endian header length, a JSON header (name -> dtype, shape, byte range), then
    the raw data. :meth:`view` is a NumPy array on the mapped bytes (no copy: the page cache's pages are the
    array); :meth:`release` unmaps a consumed range from this process (``MADV_DONTNEED``: the data stay in the
    page cache, the process's resident set drops them), so at any time only the tensors being converted count in
    the loader's RSS, not the whole shard. :meth:`prefetch` starts the kernel's read-ahead of a range.
    """

    def __init__(self, path: str):
        self.path = path
        self._map = None
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open safetensors file ({e})") from e
        try:
            self.tensors = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse_header(self) -> dict[str, TensorInfo]:
        """The header, checked in full (:func:`parse_header`). Errors name the file and what is wrong with it, never
        its bytes or (a file may not be what its name says: a link to another file) its tensor names."""
        path = self.path
        size = os.fstat(self._fd).st_size
        try:
            n = header_length(os.pread(self._fd, 8, 0), size)
            entries = parse_header(os.pread(self._fd, n, 8), size - 8 - n, names=False)
        except HeaderError as e:
            raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from None
        tensors = {name: TensorInfo(dtype, shape, 8 + n + begin, end - begin)
                   for name, (dtype, shape, begin, end) in entries.items()}
        return dict(sorted(tensors.items(), key=lambda kv: kv[1].offset))  # file order: sequential reads

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            try:
                self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.path}: cannot map safetensors file ({e})") from e
            with contextlib.suppress(AttributeError, OSError):
                self._map.madvise(mmap.MADV_SEQUENTIAL)
        return self._map

    def _range(self, name: str, first_row: int = 0, rows: int | None = None) -> tuple[int, int, tuple]:
        info = self.tensors[name]
        if not info.shape:
            return info.offset, info.nbytes, ()
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        rows = info.shape[0] - first_row if rows is None else rows
        return info.offset + first_row * row_bytes, rows * row_bytes, (rows,) + info.shape[1:]

    def view(self, name: str, first_row: int = 0, rows: int | None = None) -> np.ndarray:
        """The tensor (rows ``first_row : first_row + rows`` of axis 0) as a read-only array on the mapping."""
        offset, nbytes, shape = self._range(name, first_row, rows)
        dtype = self.tensors[name].dtype
        return np.frombuffer(self._mapping(), dtype, nbytes // dtype.itemsize, offset).reshape(shape)

    def _advise(self, advice, name: str, first_row: int, rows: int | None, *, inner: bool) -> None:
        offset, nbytes, _ = self._range(name, first_row, rows)
        page = mmap.PAGESIZE
        lo = -(-offset // page) * page if inner else offset // page * page
        hi = (offset + nbytes) // page * page if inner else -(-(offset + nbytes) // page) * page
        hi = min(hi, len(self._mapping()))
        if hi > lo:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                self._mapping().madvise(advice, lo, hi - lo)

    def prefetch(self, name: str, first_row: int = 0, rows: int | None = None) -> None:
        """Start reading the range from disk in the background (``MADV_WILLNEED``)."""
        self._advise(getattr(mmap, "MADV_WILLNEED", None), name, first_row, rows, inner=False)

    def release(self, name: str, first_row: int = 0, rows: int | None = None) -> None:
        """Drop the range's pages from this process (they stay cached); only whole pages inside the range, so a
        neighbouring tensor still being read keeps its pages."""
        self._advise(getattr(mmap, "MADV_DONTNEED", None), name, first_row, rows, inner=True)

    def read_into(self, name: str, out: np.ndarray, first_row: int = 0) -> None:
        """Fill ``out`` (a byte buffer) with the tensor's bytes from row ``first_row`` of axis 0 on (``pread``)."""
        info = self.tensors[name]
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
        offset, view, done = info.offset + first_row * row_bytes, memoryview(out).cast("B"), 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: tensor '{name}' cannot be read (file ended early)")
            done += got

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an array still refers to the mapping: it goes when that array does
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------

def write_safetensors(path: str, tensors: list[tuple[str, tuple, np.dtype]], fill) -> None:
    """Write one safetensors file, tensor by tensor: ``fill(name)`` returns the array (never all at once)."""
    dtype_names = {dtype: name for name, dtype in ST_DTYPES.items()}
    header, offset = {}, 0
    for name, shape, dtype in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_names[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset,
                                                                                                    offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, dtype in tensors:
            a = np.ascontiguousarray(fill(name))
            if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
                raise ValueError(f"{name}: fill returned {a.dtype}{a.shape}, declared {np.dtype(dtype)}{tuple(shape)}")
            f.write(a.reshape(-1).view(np.uint8))  # the array's own bytes, no copy


def write_sharded(out_dir: str, specs: list[tuple[str, tuple, np.dtype]], fill, *, max_shard_bytes: int) -> list[str]:
    """Sharded safetensors in the Hugging Face naming (``model-00001-of-00004.safetensors``) plus
    ``model.safetensors.index.json``. Returns the shard paths."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[1], dtype=np.int64)) * np.dtype(spec[2]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    n = len(shards)
    weight_map, paths, total = {}, [], 0
    for k, shard in enumerate(shards, 1):
        fn = f"model-{k:05d}-of-{n:05d}.safetensors"
        write_safetensors(os.path.join(out_dir, fn), shard, fill)
        paths.append(os.path.join(out_dir, fn))
        for name, shape, dtype in shard:
            weight_map[name] = fn
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return paths
