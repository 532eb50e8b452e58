"""Weights in the checkpoint's layout (issue 39): projection matrices are stored ``[out, in]`` as the published
checkpoints store them, q|k|v and gate|up fused into one leaf each (their rows, shard-major for TP), so loading a
checkpoint in its own dtype copies every tensor's bytes into its rows (LLaDA2's fused ``query_key_value`` on one
shard: the leaf itself) and transposes nothing; directories converted before either layout change still load."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.model.checkpoint_names import convert, hf_tensor_parts
from dllm_jax.model.loader import convert_checkpoint, load_model
from dllm_jax.model.params import get_leaf, has_leaf, param_shapes, param_table
from dllm_jax.testing import published


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def _part_value(cfg, params, part):
    """What ``part`` filled: its leaf, one expert's row of it, one segment's rows of a fused leaf."""
    from dllm_jax.model.fused import segment_of

    a = np.asarray(get_leaf(params, part.path))
    a = a[part.expert] if part.expert is not None else a
    if part.segment is None:
        return a
    leaf = param_table(cfg).leaf(part.path)
    return segment_of(cfg, leaf, a, part.segment, leaf.row_axis - (part.expert is not None))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout, dims", [("sdar", {"tie_word_embeddings": False}), ("sdar_moe", {}), ("llada2", {})])
def test_loaded_leaves_are_the_checkpoint_bytes(tmp_path, layout, dims, tp):
    """Every leaf loaded in bf16 from a bf16 checkpoint is bit for bit the tensors (or row slices) it came from, each
    in its rows of a fused leaf (laid out for ``tp`` shards), and the loader planned a copy, never a conversion, for
    every tensor; on one shard LLaDA2's ``query_key_value`` is the ``qkv`` leaf itself (one copy)."""
    from dllm_jax.config import ModelConfig
    from dllm_jax.model.placement import _plan
    from dllm_jax.model.params import param_dtypes
    from dllm_jax.model.safetensors_io import SafetensorsFile, safetensor_files

    pub = published.write_published(str(tmp_path / layout), layout, dims=dims, max_shard_bytes=150_000,
                                    keep_tensors=True, std=0.5, embed_std=0.5)
    model = load_model(pub.path, dtype="bfloat16", tp_shards=tp)
    cfg = model.config
    assert cfg.tp_shards == tp
    shapes = param_shapes(cfg)
    checked, segments, whole_qkv = 0, 0, 0
    for name, tensor in pub.tensors.items():
        parts = [p for p in hf_tensor_parts(cfg, name) or () if has_leaf(shapes, p.path)]
        if name == "lm_head.weight" and cfg.norm_head:
            continue  # normalised at load (test_llada2)
        for part in parts:
            got = _part_value(cfg, model.params, part)
            expected = np.asarray(convert(part.convert, tensor)).astype(got.dtype)
            assert part.convert[0] in ("id", "rows"), (name, part)
            np.testing.assert_array_equal(_bits(got), _bits(expected), err_msg=name)
            checked += 1
            segments += part.segment is not None
            whole_qkv += part.path[-1] == "qkv" and part.segment is None
    assert checked >= len(jax.tree.leaves(model.params))
    assert segments > 0  # q_proj (or, LLaDA2 on one shard, gate_proj / up_proj) into its rows of a fused leaf
    assert whole_qkv == (cfg.num_layers if layout == "llada2" and tp == 1 else 0)
    if layout == "sdar":
        assert model.params["lm_head"].shape == (cfg.vocab_size, cfg.hidden_size)  # [V, H], as the checkpoint
    layer = model.params["layers"][0]
    assert layer["qkv"].shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size) and "q" not in layer
    # the loader's plan: a copy per tensor (experts and segments: written into their leaf's rows); only a cast
    # (LLaDA2's float32 router and normalised head) runs on the device
    cfg = ModelConfig.from_model_dir(pub.path).replace(tp_shards=tp)
    dtypes = param_dtypes(cfg, jnp.bfloat16)
    files = [SafetensorsFile(p) for p in safetensor_files(pub.path)]
    try:
        jobs = [job for st in files for n, info in st.tensors.items() for job in _plan(st, n, info, cfg, shapes, dtypes)]
    finally:
        for st in files:
            st.close()
    for job in jobs:
        assert job.mode in ("whole", "expert", "fused") or job.info.dtype not in job.targets, (job.name, job.mode)
        assert all(p.convert[0] in ("id", "rows") for p in job.parts), job.name
    assert any(job.mode == "expert" for job in jobs) == (layout != "sdar")


def test_matrix_leaves_are_out_in_with_tp_axes_to_match():
    """The table's matrices are [out, in]: the fused qkv / gate_up split their first axis over TP (by shard block),
    o / down their second (in the checkpoint's order)."""
    cfg = _untied_cfg()
    table = param_table(cfg)
    rows = {leaf.key: leaf for leaf in table.leaves if leaf.where in ("layer", "dense", "top")}
    assert rows["qkv"].axes == ("qkv", "hidden") and rows["o"].axes == ("hidden", "q_heads")
    assert [seg.key for seg in rows["qkv"].segments] == ["q", "k", "v"]
    assert rows["gate_up"].axes == ("gate_up", "hidden") and rows["down"].axes == ("hidden", "mlp")
    assert [seg.key for seg in rows["gate_up"].segments] == ["gate", "up"]
    assert rows["lm_head"].axes == ("vocab", "hidden") == rows["embed"].axes
    assert all(leaf.matrix for leaf in table.leaves if leaf.init == "normal" and leaf.key != "embed")


def _untied_cfg():
    from dllm_jax.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, tie_word_embeddings=False)


@pytest.mark.parametrize("version", [1, 2])
def test_older_converted_directories_still_load(tmp_path, version):
    """A ``dllm-jax convert`` output of format version 2 stored q / k / v and gate / up as separate leaves, version 1
    also stored matrices [in, out]: they load (and update weights) as the same model, each segment copied into its
    fused leaf (version 1's matrices transposed on the way in), on one shard and laid out for two."""
    from conftest import build_tiny_model
    from dllm_jax.model.converted import ORBAX_MARKER, ORBAX_PARAMS_DIR, converted_version
    from dllm_jax.model.fused import split_fused, unfused_rows
    from dllm_jax.model.params import key_path
    from dllm_jax.model.weight_update import apply_directory, plan_directory

    hf = build_tiny_model(tmp_path / "hf", tie=False)
    v3 = tmp_path / "v3"
    convert_checkpoint(hf, str(v3))
    assert converted_version(str(v3)) == 3
    ref = load_model(hf)
    # rewrite it as version 2 (unfused leaves) or 1 (unfused, matrix tensors [in, out])
    old = tmp_path / f"v{version}"
    os.makedirs(old / ORBAX_PARAMS_DIR)
    for f in os.listdir(v3):
        if f not in (ORBAX_PARAMS_DIR, ORBAX_MARKER):
            (old / f).write_bytes((v3 / f).read_bytes())
    rows = unfused_rows(ref.config)
    flat, _ = jax.tree_util.tree_flatten_with_path(split_fused(ref.config, load_model(str(v3)).params))
    arrays = {}
    for tree_path, a in flat:
        path = key_path(tree_path)
        a = np.asarray(a)
        if version == 1 and get_leaf(rows, path)[0].matrix:
            a = np.ascontiguousarray(a.swapaxes(-1, -2))
        arrays[".".join(str(p) for p in path)] = a
    assert "layers.0.q" in arrays and "layers.0.gate" in arrays
    from dllm_jax.model.safetensors_io import write_sharded

    write_sharded(str(old / ORBAX_PARAMS_DIR), [(n, a.shape, a.dtype) for n, a in arrays.items()],
                  arrays.__getitem__, max_shard_bytes=1 << 30)
    marker = json.loads((v3 / ORBAX_MARKER).read_text())
    (old / ORBAX_MARKER).write_text(json.dumps(dict(marker, version=version)))
    for tp in (1, 2):
        want = load_model(hf, tp_shards=tp).params
        got = load_model(str(old), tp_shards=tp)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got.params, want)
        # a weight update from the old directory, over zeroed weights, restores the model
        params = jax.tree.map(jnp.zeros_like, want)
        plan = plan_directory(got.config, params, str(old))
        try:
            apply_directory(got.config, params, plan)
        finally:
            plan.close()
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, want)
    # and the current format loads laid out for two shards too
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 load_model(str(v3), tp_shards=2).params, load_model(hf, tp_shards=2).params)


def test_denoise_step_copies_no_weight(tmp_path):
    """The compiled bf16 denoise step (a device loop) reads every matrix and the embedding in place: no transposed
    copy of an [out, in] matrix (XLA:CPU made one of every weight per call for a 3D ``x . w^T``) and no float32
    copy of the embedding (the bf16 gather's conversion hoisted out of the loop: 1.16 GiB at the 1.7B shape)."""
    import re

    from dllm_jax import Engine
    from dllm_jax.config import ModelConfig
    from dllm_jax.model.converted import save_hf
    from dllm_jax.model.params import init_params

    # weight dims (40, 20, 72, 1000) unlike any activation's row count (8 rows x B = 32; prefill 16)
    cfg = ModelConfig(vocab_size=1000, hidden_size=40, intermediate_size=72, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=10, max_position_embeddings=256, mask_token_id=999, block_size=4, eos_token_ids=(998,),
                      tie_word_embeddings=True)
    save_hf(init_params(cfg, jax.random.PRNGKey(0)), cfg, str(tmp_path / "m"))
    engine = Engine(str(tmp_path / "m"), dtype="bfloat16", max_running_requests=4, context_length=64, num_kv_pages=40,
                    shape_buckets=dict(rows=(8,), pages=(16,), prefill_rows=(1,), prefill_blocks=(4,)))
    try:
        key = next(k for k in engine.runner.buckets() if k[0] == "denoise")
        compiled = engine.runner._lower(key).compile()
    finally:
        engine.shutdown()
    weights = {tuple(leaf.shape) for leaf in jax.tree.leaves(engine.runner.params) if leaf.ndim == 2}
    weights |= {s[::-1] for s in weights}
    # arrays the program materialises (outside fusion bodies, where a conversion is computed element by element for
    # the gathered rows only) that have a weight's shape, in either orientation
    made, fused_body = [], False
    for line in compiled.as_text().splitlines():
        if line and not line[0].isspace():  # a computation's header
            fused_body = line.startswith(("%fused", "%wrapped")) or "_computation" in line.split(" ")[0]
        m = re.match(r"\s*(ROOT )?%[\w.-]*(copy|convert|transpose)[\w.-]* = \w+\[(\d+),(\d+)\]", line)
        if m and not fused_body and (int(m.group(3)), int(m.group(4))) in weights:
            made.append(line.strip()[:120])
    assert made == []
