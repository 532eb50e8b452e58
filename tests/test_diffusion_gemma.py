"""DiffusionGemma's model against transformers (the reference), on tiny checkpoints transformers writes itself.

The encoder writes its K/V into a paged pool (pages of 4 tokens, chunks and canvases not aligned to them); the
decoder reads it. Both are compared with ``DiffusionGemmaForBlockDiffusion`` run on the same weights: per layer
K/V of the cache, and the decoder's soft-capped logits, on the first canvas and on a later one (after the encoder
has encoded the first), with and without self-conditioning, on prompts longer than the sliding window.
float32 agrees within 1e-4 relative; bfloat16 is classified against the float32 reference (our error is that of
transformers' own bfloat16 run, within a factor).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dllm_jax.model import gemma  # noqa: E402
from dllm_jax.model.loader import load_model  # noqa: E402
from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma  # noqa: E402

PAGE = 4  # tokens per page: neither the prompts nor the canvases align to it
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 50, 7]  # 13 tokens: longer than every window below

CONFIGS = {
    "tied_2full": dict(),
    "untied": dict(tie=False),
    "one_full_top1_8experts": dict(layer_types=[SLIDING, SLIDING, SLIDING, FULL], num_experts=8, top_k_experts=1),
    "window_3_top2_8experts": dict(sliding_window=3, num_experts=8, top_k_experts=2),
    "global_dims_like_sliding_top1": dict(global_head_dim=8, num_global_key_value_heads=2, canvas_length=5,
                                          top_k_experts=1),
    "clipped_vision_untied": dict(tie=False, clipped_vision=True, global_head_dim=32, num_global_key_value_heads=2),
}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _page_tables(cfg, length):
    pages = -(-length // PAGE)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None, :]
    return {gemma.SLIDING_KIND: table, gemma.FULL_KIND: table}, pages + 1


def _reference_run(model, prompt, canvases, sc_logits):
    """transformers: encode the prompt, decode canvas 0; encode canvas 0, decode canvas 1 (self-conditioned by
    ``sc_logits[i]`` when given). Returns the logits of each decode and the cache's K/V after each encode."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    ids, start, out, kvs = torch.tensor([prompt]), 0, [], []
    with torch.no_grad():
        for i, canvas in enumerate(canvases):
            model.model.encoder(input_ids=ids, cache=cache,
                                position_ids=torch.arange(start, start + ids.shape[1])[None])
            kvs.append([(layer.keys[0].float().numpy(), layer.values[0].float().numpy()) for layer in cache.layers])
            start += ids.shape[1]
            sc = None if sc_logits[i] is None else torch.tensor(np.asarray(sc_logits[i]))[None].to(model.dtype)
            logits = model(decoder_input_ids=torch.tensor([canvas]), cache=cache, self_conditioning_logits=sc,
                           decoder_position_ids=torch.arange(start, start + len(canvas))[None]).logits
            out.append(logits[0].float().numpy())
            ids = torch.tensor([canvas])
    return out, kvs


CHUNK = 8  # encoder chunks are padded to this many tokens (the rest write to the trash page), as the engine's


def _our_run(params, cfg, prompt, canvases, sc_logits, dtype, chunks=(5,)):
    """The same through our paged forwards (the prompt encoded in chunks split at ``chunks``, each padded to
    CHUNK tokens; the first step's self-conditioning input is the zeros transformers uses for "none")."""
    total = len(prompt) + len(canvases) * len(canvases[0])
    tables, num_pages = _page_tables(cfg, total)
    pool = gemma.init_kv_pages(cfg, {gemma.SLIDING_KIND: num_pages, gemma.FULL_KIND: num_pages}, PAGE, dtype)
    pieces = np.split(np.asarray(prompt), list(chunks))
    start, out, kvs = 0, [], []
    for i, canvas in enumerate(canvases):
        for piece in pieces:
            padded = np.zeros(CHUNK, np.int32)
            padded[:len(piece)] = piece
            pool = gemma.encode_chunk_jit(params, cfg, jnp.asarray(padded)[None], jnp.asarray([start]),
                                          jnp.asarray([len(piece)]), pool, tables)
            start += len(piece)
        kvs.append(_pool_kv(params, cfg, pool, tables, start, dtype))
        sc = jnp.zeros((1, len(canvas), cfg.hidden_size), dtype) if sc_logits[i] is None else \
            gemma.soft_embedding_jit(params, cfg, jnp.asarray(sc_logits[i])[None])
        hidden = gemma.decode_canvas_jit(params, cfg, jnp.asarray(canvas)[None], jnp.asarray([start]), pool, tables, sc)
        out.append(np.asarray(gemma.logits_jit(params, cfg, hidden)[0]))
        pieces = [np.asarray(canvas)]
    return out, kvs


def _pool_kv(params, cfg, pool, tables, length, dtype):
    """Per layer (K, V) ``[Hkv, length, D]`` as the pool holds them (a full layer's derived from its raw k)."""
    out = []
    for i, layer in enumerate(params["layers"]):
        g = gemma.geometry(cfg, i)
        k, v = gemma._prefix_kv(layer, pool[i], gemma._table(tables, g), g, cfg, dtype)
        out.append((np.asarray(k[0, :length].astype(jnp.float32)).transpose(1, 0, 2),
                    np.asarray(v[0, :length].astype(jnp.float32)).transpose(1, 0, 2)))
    return out


def _compare_kv(ref_kvs, our_kvs, tol):
    worst = 0.0
    for ref, ours in zip(ref_kvs, our_kvs):
        for (rk, rv), (ok, ov) in zip(ref, ours):
            n = rk.shape[1]  # a sliding cache layer keeps only the last window - 1 tokens: compare those
            worst = max(worst, _rel(ok[:, -n:], rk), _rel(ov[:, -n:], rv))
    assert worst < tol, worst
    return worst


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forwards_equal_transformers_float32(tmp_path, name):
    kwargs = CONFIGS[name]
    model = write_tiny_diffusion_gemma(tmp_path, **kwargs)
    loaded = load_model(tmp_path)
    cfg, params = loaded.config, loaded.params
    canvas_len = cfg.block_size
    rng = np.random.default_rng(0)
    canvases = [rng.integers(0, cfg.vocab_size, canvas_len).tolist() for _ in range(2)]
    sc_logits = [None, rng.normal(0, 3, (canvas_len, cfg.vocab_size)).astype(np.float32)]
    ref_logits, ref_kvs = _reference_run(model, PROMPT, canvases, sc_logits)
    our_logits, our_kvs = _our_run(params, cfg, PROMPT, canvases, sc_logits, jnp.float32)
    for ours, ref in zip(our_logits, ref_logits):
        assert _rel(ours, ref) < 1e-4, _rel(ours, ref)
    _compare_kv(ref_kvs, our_kvs, 1e-4)
    if name not in ("tied_2full", "untied"):
        return
    # the first canvas self-conditioned too, and the prompt in other chunks: the same
    sc_first = [sc_logits[1], None]
    ref_logits, _ = _reference_run(model, PROMPT, canvases, sc_first)
    our_logits, _ = _our_run(params, cfg, PROMPT, canvases, sc_first, jnp.float32, chunks=(1, 2, 9, 11))
    for ours, ref in zip(our_logits, ref_logits):
        assert _rel(ours, ref) < 1e-4, _rel(ours, ref)


def test_bfloat16_within_bfloat16_rounding(tmp_path):
    """bf16 vs the float32 reference: our error is of the size of transformers' own bf16 error.

    Every expert is chosen here (top-k = E): a top-k choice between two experts whose router probabilities are
    closer than bf16 resolves is a discrete decision that rounding may take either way (measured on this very
    checkpoint with top-2: token 14 of layer 0 has its 2nd / 3rd probabilities 0.24836 / 0.24772, and transformers'
    bf16 run and ours break that tie differently), which is not rounding error; the float32 tests check routing."""
    model = write_tiny_diffusion_gemma(tmp_path, top_k_experts=4)
    rng = np.random.default_rng(1)
    cfg32 = load_model(tmp_path).config
    canvases = [rng.integers(0, cfg32.vocab_size, cfg32.block_size).tolist() for _ in range(2)]
    sc_logits = [None, rng.normal(0, 3, (cfg32.block_size, cfg32.vocab_size)).astype(np.float32)]
    ref32, _ = _reference_run(model, PROMPT, canvases, sc_logits)
    ref16, _ = _reference_run(model.to(torch.bfloat16), PROMPT, canvases, sc_logits)
    loaded = load_model(tmp_path, dtype="bfloat16")
    ours16, _ = _our_run(loaded.params, loaded.config, PROMPT, canvases, sc_logits, jnp.bfloat16)
    for ours, theirs, exact in zip(ours16, ref16, ref32):
        their_err, our_err = _rel(theirs, exact), _rel(ours, exact)
        assert their_err > 0 and our_err < 2.0 * their_err + 2 ** -8, (our_err, their_err)


def test_published_layout_variants_load_alike(tmp_path):
    """Tied tensors stored twice (encoder and decoder names) load as stored once; vision tensors are skipped; a
    full layer holding a v projection is an error naming the tensor."""
    from safetensors.numpy import load_file, save_file

    once = tmp_path / "once"
    write_tiny_diffusion_gemma(once)
    twice = tmp_path / "twice"
    twice.mkdir()
    tensors = load_file(once / "model.safetensors")
    assert any(k.startswith("model.encoder.vision_tower.") for k in tensors)
    for name in list(tensors):
        if name.startswith("model.decoder.") and "self_conditioning" not in name and "layer_scalar" not in name:
            tensors["model.encoder.language_model." + name[len("model.decoder."):]] = tensors[name]
    tensors["lm_head.weight"] = tensors["model.decoder.embed_tokens.weight"]
    save_file(tensors, twice / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        (twice / f).write_text((once / f).read_text())
    from dllm_jax.model.loader import convert_checkpoint

    convert_checkpoint(str(once), str(tmp_path / "converted"))  # `dllm-jax convert`: our layout, loads as stored
    a = load_model(once).params
    for other in (twice, tmp_path / "converted"):
        b = load_model(other).params
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(once / "model.safetensors")
    tensors["model.decoder.layers.1.self_attn.v_proj.weight"] = tensors["model.decoder.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        (bad / f).write_text((once / f).read_text())
    with pytest.raises(ValueError, match=r"v_proj.*full-attention"):
        load_model(bad)


def test_config_defaults_and_refusals(tmp_path):
    from dllm_jax.config import ConfigError, ModelConfig

    write_tiny_diffusion_gemma(tmp_path, layer_types=None, num_hidden_layers=7)
    hf = json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL, FULL)  # 5:1, the last forced full
    assert cfg.rope_full == ("proportional", 1e6, 0.25, 1.0) and cfg.rope_sliding[:2] == ("default", 1e4)
    assert cfg.block_size == 4 and cfg.final_logit_softcapping == 30.0
    # a published-style config: global_head_dim / num_global_key_value_heads instead of per_layer_config
    text = dict(hf["text_config"])
    text.pop("per_layer_config")
    text.update(global_head_dim=24, num_global_key_value_heads=1)
    cfg = ModelConfig.from_hf_dict(dict(hf, text_config=text))
    assert (cfg.global_head_dim, cfg.num_global_kv_heads, cfg.layer_head_dim(5), cfg.layer_head_dim(0)) == (24, 1, 24, 8)
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(dict(hf, text_config=dict(text, use_bidirectional_attention="all")))
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_hf_dict({k: v for k, v in hf.items() if k != "text_config"})


def test_sliding_layers_never_read_pages_older_than_their_window(tmp_path):
    """Pointing a sliding layer's pages that lie wholly before its window at the trash page (and scribbling on the
    pages it no longer holds) changes neither the decoder's logits nor a later encoder chunk: those pages can be
    freed."""
    write_tiny_diffusion_gemma(tmp_path, sliding_window=3)
    loaded = load_model(tmp_path)
    cfg, params = loaded.config, loaded.params
    prompt = jnp.asarray(PROMPT)[None]
    tables, num_pages = _page_tables(cfg, 32)
    pool = gemma.init_kv_pages(cfg, {gemma.SLIDING_KIND: num_pages, gemma.FULL_KIND: num_pages}, PAGE)
    pool = gemma.encode_chunk_jit(params, cfg, prompt, jnp.asarray([0]), jnp.asarray([len(PROMPT)]), pool, tables)
    canvas = jnp.asarray([[1, 2, 3, 4]])
    L = len(PROMPT)
    first_needed = (L - (cfg.sliding_window - 1)) // PAGE  # the decoder's and the next chunk's oldest page
    trimmed = dict(tables, sliding=tables[gemma.SLIDING_KIND].at[:, :first_needed].set(0))
    scribbled = [tuple(p.at[:, 1:1 + first_needed].set(7.0) for p in layer) if len(layer) == 2 else layer
                 for layer in pool]
    want = gemma.logits_jit(params, cfg, gemma.decode_canvas_jit(params, cfg, canvas, jnp.asarray([L]), pool, tables))
    got = gemma.logits_jit(params, cfg, gemma.decode_canvas_jit(params, cfg, canvas, jnp.asarray([L]), scribbled, trimmed))
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
    _, h1 = gemma.encode_chunk_jit(params, cfg, canvas, jnp.asarray([L]), jnp.asarray([4]), pool, tables, return_hidden=True)
    _, h2 = gemma.encode_chunk_jit(params, cfg, canvas, jnp.asarray([L]), jnp.asarray([4]), scribbled, trimmed,
                               return_hidden=True)
    np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))


def test_engine_loads_with_the_published_defaults(tmp_path):
    """``dllm_jax.Engine(model_path=DIR)`` on a directory transformers wrote: the family, the canvas as the block,
    Gemma4Renoise with transformers' defaults (generation_config.json leaves them unset)."""
    import dllm_jax

    write_tiny_diffusion_gemma(tmp_path)
    engine = dllm_jax.Engine(model_path=str(tmp_path), warmup=False)
    try:
        info = engine.get_model_info()
        assert info["architecture"] == "DiffusionGemmaForBlockDiffusion" and info["canvas_length"] == 4
        assert info["family"] == "diffusion_gemma" and info["algorithm"] == "Gemma4Renoise"
        assert info["algorithm_config"] == {
            "max_denoising_steps": 48, "sampler_config": {"entropy_bound": 0.1},
            "temperature_schedule": {"t_min": 0.4, "t_max": 0.8},
            "stopping_config": {"confidence_threshold": 0.005, "stability_threshold": 1}}
    finally:
        engine.shutdown()


def test_generation_config_gives_the_denoising_defaults(tmp_path):
    """generation_config.json as transformers serialises DiffusionGemma's (the entropy bound in its sampler
    dataclass's dict, null for unset keys); bad values are errors naming the file and key."""
    from dllm_jax.model.errors import CheckpointError
    from dllm_jax.model.generation import renoise_defaults

    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"max_denoising_steps": 16, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig",
                               "entropy_bound": 0.25}, "t_min": 0.2, "t_max": None, "stability_threshold": 2,
                               "confidence_threshold": 0.01, "eos_token_id": [1, 106]}))
    assert renoise_defaults(str(tmp_path)) == {"max_denoising_steps": 16, "entropy_bound": 0.25, "t_min": 0.2,
                                               "t_max": 0.8, "stability_threshold": 2, "confidence_threshold": 0.01}
    for bad, match in (({"t_min": 0.9}, "t_max must be greater"), ({"max_denoising_steps": 0}, "max_denoising_steps"),
                       ({"sampler_config": {"entropy_bound": 0}}, "sampler_config.entropy_bound"),
                       ({"stability_threshold": 1.5}, "stability_threshold")):
        gen.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=match):
            renoise_defaults(str(tmp_path))
