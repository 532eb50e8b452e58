"""The packed per-row format of a device call (dllm_jax.decode.packing): bit-exact both ways."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decode.packing import RowLayout

LAYOUT = RowLayout((("tokens", (4,), "int32"), ("immutable", (4,), "bool"), ("temperature", (), "float32"),
                    ("seed", (), "uint32"), ("written", (2, 3), "int32"), ("done", (), "bool")))


def _values(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(-2**31, 2**31 - 1, (rows, 4)).astype(np.int32),
            "immutable": rng.random((rows, 4)) < 0.5,
            # signed zero, infinities, a NaN and a subnormal survive: 32-bit fields are bitcast, never converted
            "temperature": np.array([-0.0, np.inf, np.nan, 1e-45, 0.7][:rows], np.float32),
            "seed": np.array([0, 2**32 - 1, 2**31, 7, 12345][:rows], np.uint32),
            "written": rng.integers(-5, 5, (rows, 2, 3)).astype(np.int32),
            "done": np.array([True, False, True, True, False][:rows])}


def _assert_bit_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        g = np.asarray(got[name])
        assert g.dtype == value.dtype and g.shape == value.shape, name
        assert g.tobytes() == value.tobytes(), name


def test_host_views_pack_what_the_device_unpacks_bit_for_bit():
    values = _values(5)
    packed, views = LAYOUT.empty(5)
    assert packed.shape == (5, LAYOUT.width) and LAYOUT.width == 4 + 4 + 1 + 1 + 6 + 1
    for name, value in values.items():
        views[name][:] = value
        assert np.shares_memory(views[name], packed), name  # a view, not a copy: writes land in the packed array
    on_device = jax.jit(LAYOUT.unpack)(jnp.asarray(packed))
    _assert_bit_equal(on_device, values)
    _assert_bit_equal(LAYOUT.unpack(packed), values)
    assert LAYOUT.view(packed, "seed").dtype == np.uint32 and LAYOUT.view(packed, "seed")[1] == 2**32 - 1


def test_device_pack_is_what_the_host_unpacks_bit_for_bit():
    values = _values(5)
    packed = jax.jit(LAYOUT.pack)({k: jnp.asarray(v) for k, v in values.items()})
    assert packed.dtype == jnp.int32 and packed.shape == (5, LAYOUT.width)
    _assert_bit_equal(LAYOUT.unpack(np.array(packed)), values)


def test_layout_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError, match="'x'.*float64"):
        RowLayout((("x", (), "float64"),))
    with pytest.raises(ValueError, match="'tokens'"):
        LAYOUT.pack({**{k: jnp.asarray(v) for k, v in _values(2).items()}, "tokens": jnp.zeros((2, 5), jnp.int32)})
