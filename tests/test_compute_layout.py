"""The forwards' ``[in, out]`` compute copies (dllm_jax.model.compute_layout): the same products as the stored
``[out, in]`` matrices, made anew whenever a stored leaf is replaced (weight updates, resume), freed on release,
and lowered for with the tree the calls pass."""

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.model import compute_layout
from dllm_jax.model.compute_layout import HEAD_KEY, ComputeCopies, InOut
from dllm_jax.model.moe import contract, linear


def _params(seed: int = 0):
    rng = np.random.default_rng(seed)

    def m(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    layer = {"attn_norm": m(8), "qkv": m(16, 8), "o": m(8, 8), "mlp_norm": m(8), "gate_up": m(24, 8), "down": m(8, 12)}
    return {"embed": m(40, 8), "final_norm": m(8), "layers": [layer, dict(layer, o=m(8, 8))]}


def test_a_copy_contracts_like_the_stored_matrix():
    p = _params()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 8)).astype(np.float32))
    for w in (p["layers"][0]["qkv"], p["embed"]):
        copy = InOut(jnp.asarray(np.asarray(w).T))
        assert copy.shape == w.shape
        np.testing.assert_allclose(contract(x, copy), contract(x, w), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(linear(x.astype(jnp.bfloat16), copy), linear(x.astype(jnp.bfloat16), w),
                                   rtol=2e-2, atol=2e-2)


def test_copies_follow_the_stored_leaves():
    params = _params()
    copies = ComputeCopies(True)
    v1 = copies.view(params)
    assert copies.view(params) is v1  # nothing replaced: the same tree, nothing copied
    assert isinstance(params["layers"][0]["qkv"], jax.Array)  # the stored tree is left as it was
    for i in range(2):
        for k in compute_layout.LAYER_MATRICES:
            np.testing.assert_array_equal(v1["layers"][i][k].t, np.asarray(params["layers"][i][k]).T)
        assert v1["layers"][i]["attn_norm"] is params["layers"][i]["attn_norm"]
    np.testing.assert_array_equal(v1[HEAD_KEY].t, np.asarray(params["embed"]).T)  # tied: the embedding's copy
    assert v1["embed"] is params["embed"]

    # a leaf replaced in place (as update_weights_* do): its copy anew, the others kept
    params["layers"][1]["o"] = params["layers"][1]["o"] * 2
    v2 = copies.view(params)
    np.testing.assert_array_equal(v2["layers"][1]["o"].t, np.asarray(params["layers"][1]["o"]).T)
    assert v2["layers"][0]["qkv"] is v1["layers"][0]["qkv"]
    params["final_norm"] = params["final_norm"] + 1  # a leaf without a copy: the tree anew, no copy
    v3 = copies.view(params)
    assert v3["final_norm"] is params["final_norm"] and v3["layers"][1]["o"] is v2["layers"][1]["o"]

    # what calls are lowered for: the tree and shapes the calls pass
    shapes = compute_layout.abstract(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params))
    assert jax.tree.structure(shapes) == jax.tree.structure(v3)
    assert [a.shape for a in jax.tree.leaves(shapes)] == [a.shape for a in jax.tree.leaves(v3)]

    copies.drop()  # release: the copies go; the next view makes them from the (restored) leaves
    assert v3["layers"][0]["qkv"].t.is_deleted()
    v4 = copies.view(params)
    np.testing.assert_array_equal(v4["layers"][0]["qkv"].t, np.asarray(params["layers"][0]["qkv"]).T)


def test_only_small_single_device_models_on_cpu_copy():
    params = _params()
    assert ComputeCopies(False).view(params) is params
    assert compute_layout.wanted(params) == (jax.default_backend() == "cpu")
    assert not compute_layout.wanted(params, multi_process=True)
    big = {"layers": [{"qkv": jax.ShapeDtypeStruct((compute_layout.MAX_COPY_BYTES // 4 + 1, 1), jnp.float32)}]}
    assert not compute_layout.wanted(big)
