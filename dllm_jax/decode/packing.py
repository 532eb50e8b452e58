"""A device call's per-row arrays side by side in one ``int32`` array, and back.

A denoise call has a dozen per-row inputs (tokens, immutable mask, page table, sampling parameters, the
algorithm's state, the optional penalty tables) and half a dozen per-row results. Moved one by one, each is a
separate host-to-device or device-to-host copy with its own fixed cost (tens of microseconds apiece on XLA:CPU
for a few hundred bytes, a synchronised copy each on a GPU); at one request on a small model those copies were a
tenth of the run. Packed, a call moves one array each way. 32-bit fields are bitcast (bit-exact), bools are 0 / 1.

A :class:`RowLayout` names the fields and their per-row shapes; it is hashable, so the jitted step takes it as a
static argument and unpacks with slices that XLA fuses away.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = ("int32", "uint32", "float32", "bool")


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """``fields``: (name, shape of one row's value, dtype name) in column order."""

    fields: tuple[tuple[str, tuple[int, ...], str], ...]

    def __post_init__(self):
        for name, _, dtype in self.fields:
            if dtype not in _DTYPES:
                raise ValueError(f"field {name!r}: dtype {dtype} cannot be packed (one of {_DTYPES})")

    @functools.cached_property
    def _columns(self) -> dict[str, tuple[tuple[int, ...], str, int, int]]:
        """name -> (shape, dtype, first column, end column); computed once per layout (the runner keeps one per
        bucket), since every call reads it."""
        out, start = {}, 0
        for name, shape, dtype in self.fields:
            stop = start + math.prod(shape)
            out[name] = (shape, dtype, start, stop)
            start = stop
        return out

    @functools.cached_property
    def width(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.fields)

    def view(self, packed: np.ndarray, name: str) -> np.ndarray:
        """One field of :meth:`views`."""
        shape, dtype, start, stop = self._columns[name]
        column = packed[:, start] if shape == () else packed[:, start:stop].reshape((packed.shape[0], *shape))
        return column.view(dtype) if dtype in ("uint32", "float32") else column

    def views(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        """Writable views into a host array ``int32 [R, width]``, one per field shaped ``[R, *shape]``: 32-bit
        fields in their own dtype, bools as 0 / 1 ints (assigning a bool array to them stores 0 / 1)."""
        return {name: self.view(packed, name) for name, _, _ in self.fields}

    def empty(self, rows: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A zeroed host array for ``rows`` rows and its :meth:`views`."""
        packed = np.zeros((rows, self.width), np.int32)
        return packed, self.views(packed)

    def unpack(self, packed) -> dict:
        """The fields of a packed array (host ``np.ndarray`` or traced ``jax.Array``), in their own dtypes."""
        on_host = isinstance(packed, np.ndarray)
        rows = packed.shape[0]
        out = {}
        for name, (shape, dtype, start, stop) in self._columns.items():
            x = packed[:, start:stop].reshape((rows, *shape))
            if dtype == "bool":
                x = x != 0
            elif dtype != "int32":
                x = x.view(dtype) if on_host else jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
            out[name] = x
        return out

    def pack(self, arrays: dict) -> jax.Array:
        """Inside a jitted function: ``arrays`` (every field, ``[R, *shape]`` each) as one ``int32 [R, width]``."""
        cols = []
        for name, (shape, dtype, _, _) in self._columns.items():
            x = arrays[name]
            if x.shape[1:] != shape or x.dtype != jnp.dtype(dtype):
                raise ValueError(f"field {name!r}: expected {dtype}{list(shape)} per row, "
                                 f"got {x.dtype}{list(x.shape[1:])}")
            x = x.reshape(x.shape[0], -1)
            if dtype == "bool":
                x = x.astype(jnp.int32)
            elif dtype != "int32":
                x = jax.lax.bitcast_convert_type(x, jnp.int32)
            cols.append(x)
        return jnp.concatenate(cols, axis=1)
