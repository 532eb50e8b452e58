"""Weights in the checkpoint's layout (issue 39): projection matrices are stored ``[out, in]`` as the published
checkpoints store them, so loading a checkpoint in its own dtype copies every tensor's bytes (a fused tensor's parts
from their row slices) and transposes nothing; directories converted before the layout change still load."""

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


@pytest.mark.parametrize("layout, dims", [("sdar", {"tie_word_embeddings": False}), ("sdar_moe", {}), ("llada2", {})])
def test_loaded_leaves_are_the_checkpoint_bytes(tmp_path, layout, dims):
    """Every leaf loaded in bf16 from a bf16 checkpoint is bit for bit the tensor (or its row slice) it came from,
    and the loader planned a copy, never a conversion, for every tensor."""
    from dllm_jax.config import ModelConfig
    from dllm_jax.model.placement import _plan
    from dllm_jax.model.params import param_dtypes
    from dllm_jax.model.safetensors_io import SafetensorsFile, safetensor_files

    pub = published.write_published(str(tmp_path / layout), layout, dims=dims, max_shard_bytes=150_000,
                                    keep_tensors=True, std=0.5, embed_std=0.5)
    model = load_model(pub.path, dtype="bfloat16")
    cfg = model.config
    shapes = param_shapes(cfg)
    checked, fused = 0, 0
    for name, tensor in pub.tensors.items():
        parts = [p for p in hf_tensor_parts(cfg, name) or () if has_leaf(shapes, p.path)]
        if name == "lm_head.weight" and cfg.norm_head:
            continue  # normalised at load (test_llada2)
        for part in parts:
            leaf = get_leaf(model.params, part.path)
            leaf = leaf[part.expert] if part.expert is not None else leaf
            expected = np.asarray(convert(part.convert, tensor)).astype(np.asarray(leaf).dtype)
            assert part.convert[0] in ("id", "rows"), (name, part)
            np.testing.assert_array_equal(_bits(leaf), _bits(expected), err_msg=name)
            checked += 1
        if len(parts) > 1:  # a fused tensor: its leaves, concatenated in table order, are the tensor
            fused += 1
            whole = np.concatenate([np.asarray(get_leaf(model.params, p.path)) for p in parts], axis=0)
            np.testing.assert_array_equal(_bits(whole), _bits(tensor.astype(whole.dtype)))
    assert checked >= len(jax.tree.leaves(model.params))
    assert fused == (cfg.num_layers if layout == "llada2" else 0)  # LLaDA2's query_key_value (+ bias when used)
    if layout == "sdar":
        assert model.params["lm_head"].shape == (cfg.vocab_size, cfg.hidden_size)  # [V, H], as the checkpoint
    # the loader's plan: a copy per tensor (experts: written into their stacked leaf); only a cast (LLaDA2's float32
    # router and normalised head) runs on the device
    cfg = ModelConfig.from_model_dir(pub.path)
    dtypes = param_dtypes(cfg, jnp.bfloat16)
    files = [SafetensorsFile(p) for p in safetensor_files(pub.path)]
    try:
        jobs = [job for st in files for n, info in st.tensors.items() for job in _plan(st, n, info, cfg, shapes, dtypes)]
    finally:
        for st in files:
            st.close()
    for job in jobs:
        assert job.mode in ("whole", "expert") or job.info.dtype not in job.targets, (job.name, job.mode)
        assert all(p.convert[0] in ("id", "rows") for p in job.parts), job.name
    assert any(job.mode == "expert" for job in jobs) == (layout != "sdar")


def test_matrix_leaves_are_out_in_with_tp_axes_to_match():
    """The table's matrices are [out, in]: q / k / v / gate / up split their first axis over TP, o / down their
    second (the same logical axes as before, in the checkpoint's order)."""
    cfg = _untied_cfg()
    table = param_table(cfg)
    rows = {leaf.key: leaf for leaf in table.leaves if leaf.where in ("layer", "dense", "top")}
    assert rows["q"].axes == ("q_heads", "hidden") and rows["o"].axes == ("hidden", "q_heads")
    assert rows["k"].axes == rows["v"].axes == ("kv_heads", "hidden")
    assert rows["gate"].axes == rows["up"].axes == ("mlp", "hidden") and rows["down"].axes == ("hidden", "mlp")
    assert rows["lm_head"].axes == ("vocab", "hidden") == rows["embed"].axes
    assert all(leaf.matrix for leaf in table.leaves if leaf.init == "normal" and leaf.key != "embed")


def _untied_cfg():
    from dllm_jax.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, tie_word_embeddings=False)


def test_version_1_converted_directory_still_loads(tmp_path):
    """A ``dllm-jax convert`` output of format version 1 stored matrices [in, out]: it loads (and updates weights)
    as the same model, its matrices transposed on the way in."""
    from conftest import build_tiny_model
    from dllm_jax.model.converted import ORBAX_MARKER, ORBAX_PARAMS_DIR, converted_version
    from dllm_jax.model.safetensors_io import SafetensorsFile, safetensor_files, write_sharded
    from dllm_jax.model.weight_update import apply_directory, plan_directory

    hf = build_tiny_model(tmp_path / "hf", tie=False)
    v2 = tmp_path / "v2"
    convert_checkpoint(hf, str(v2))
    assert converted_version(str(v2)) == 2
    ref = load_model(hf)
    # rewrite it as version 1: matrix tensors [in, out]
    v1 = tmp_path / "v1"
    os.makedirs(v1 / ORBAX_PARAMS_DIR)
    for f in os.listdir(v2):
        if f not in (ORBAX_PARAMS_DIR, ORBAX_MARKER):
            (v1 / f).write_bytes((v2 / f).read_bytes())
    table = param_table(ref.config)
    arrays = {}
    for path in safetensor_files(str(v2 / ORBAX_PARAMS_DIR)):
        st = SafetensorsFile(path)
        for name in st.tensors:
            a = np.array(st.view(name))
            key = tuple(int(p) if p.isdigit() else p for p in name.split("."))
            arrays[name] = np.ascontiguousarray(a.swapaxes(-1, -2)) if table.leaf(key, ref.config).matrix else a
        st.close()
    write_sharded(str(v1 / ORBAX_PARAMS_DIR), [(n, a.shape, a.dtype) for n, a in arrays.items()], arrays.__getitem__,
                  max_shard_bytes=1 << 30)
    marker = json.loads((v2 / ORBAX_MARKER).read_text())
    (v1 / ORBAX_MARKER).write_text(json.dumps(dict(marker, version=1)))
    old = load_model(str(v1))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), old.params, ref.params)
    # a weight update from the version-1 directory, over zeroed weights, restores the model
    params = jax.tree.map(jnp.zeros_like, ref.params)
    plan = plan_directory(ref.config, params, str(v1))
    try:
        apply_directory(ref.config, params, plan)
    finally:
        plan.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, ref.params)


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
