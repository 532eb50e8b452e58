"""DiffusionGemma with images: the vision tower, its projector and the image tokens' placement against transformers.

* The tower's soft tokens equal ``get_image_features`` (float32 rounding), clipped linears and standardize too.
* Replay (tests/test_renoise.py's): transformers' ``generate`` with ``pixel_values`` / ``image_position_ids`` /
  ``mm_token_type_ids`` runs with its random calls answered by our loop's draws; in the deterministic regime
  (untied, accept-all entropy bound, near-zero temperature) every step's argmax canvas and the final sequence are
  the same, with one image and with two (bidirectional attention over each image's tokens, as the config asks).
* The engine (``Engine.generate(image_data=...)``) answers like the loop, from bytes, a path, base64 and a data URL
  alike; the prefix cache reuses an image's pages for the same image and never for a different one; bad images are
  ``ValueError`` s naming the field.
"""

from __future__ import annotations

import base64
import io

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dllm_jax  # noqa: E402
from dllm_jax.decode import renoise  # noqa: E402
from dllm_jax.decode.renoise_loop import RenoiseLoop  # noqa: E402
from dllm_jax.engine.images import ImageInputs  # noqa: E402
from dllm_jax.model.loader import load_model  # noqa: E402
from dllm_jax.model.vision import VisionConfig, image_features  # noqa: E402
from dllm_jax.model.vision_params import load_vision_params  # noqa: E402
from dllm_jax.testing.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma  # noqa: E402
from test_renoise import _DraftRecorder, _our_run, _Replay, _sampler  # noqa: E402

# near-argmax sampling, every position accepted each step (the deterministic regime)
EXACT = renoise.RenoiseConfig(max_denoising_steps=4, entropy_bound=1e9, t_min=0.0, t_max=1e-3)
VOCAB = 96
IMAGE = VOCAB - 3  # the tiny checkpoint's image token (testing/diffusion_gemma.py: image_token_ids)


def _png(seed: int, size=(20, 28)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dg_images")
    # window 6 is shorter than an image (tens of tokens): an image token sees its whole image all the same
    model = write_tiny_diffusion_gemma(path, canvas_length=4, tie=False, sliding_window=6, num_hidden_layers=2,
                                       layer_types=[SLIDING, FULL], use_bidirectional_attention="vision")
    loaded = load_model(path)
    vcfg = VisionConfig.from_model_dir(str(path))
    vision = (load_vision_params(str(path), vcfg, loaded.config.hidden_size, jnp.float32), vcfg)
    return str(path), model, loaded, vision


def _reference(model, ids, images, spans, rcfg, randint, multinomial, max_new):
    pixel_values = torch.tensor(np.stack([img.pixel_values for img in images]))
    positions = torch.tensor(np.stack([img.positions for img in images])).long()
    ids_t = torch.tensor([ids])
    recorder = _DraftRecorder()
    with _Replay(randint, multinomial).patched():
        out = model.generate(ids_t, pixel_values=pixel_values, image_position_ids=positions,
                             mm_token_type_ids=(ids_t == IMAGE).long(), max_new_tokens=max_new,
                             max_denoising_steps=rcfg.max_denoising_steps, t_min=rcfg.t_min, t_max=rcfg.t_max,
                             stability_threshold=rcfg.stability_threshold,
                             confidence_threshold=rcfg.confidence_threshold,
                             sampler_config=_sampler(rcfg.entropy_bound), streamer=recorder)
    return out.sequences[0].tolist(), recorder.drafts


def test_tower_features_equal_transformers(tmp_path):
    """Clipped linears, standardize and grouped KV heads in the tower (the fixture's tower has none of them)."""
    model = write_tiny_diffusion_gemma(tmp_path, canvas_length=4, num_hidden_layers=2, layer_types=[SLIDING, FULL],
                                       clipped_vision=True, vision=dict(standardize=True, num_key_value_heads=1))
    vcfg = VisionConfig.from_model_dir(str(tmp_path))
    assert vcfg.clipped_linears and vcfg.standardize
    vparams = load_vision_params(str(tmp_path), vcfg, 32, jnp.float32)
    images = ImageInputs(str(tmp_path), vcfg).prepare([_png(1), _png(2, (31, 17))])
    pixels = np.stack([img.pixel_values for img in images])
    positions = np.stack([img.positions for img in images])
    with torch.no_grad():
        want = model.model.encoder.get_image_features(torch.tensor(pixels), torch.tensor(positions).long())
    ours = np.asarray(image_features(vparams, jnp.asarray(pixels), jnp.asarray(positions), vcfg))
    ours = np.concatenate([ours[i, :img.num_soft_tokens] for i, img in enumerate(images)])
    np.testing.assert_allclose(ours, want.pooler_output.numpy(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("count", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_replay_with_images_equals_transformers(checkpoint, count):
    path, model, loaded, vision = checkpoint
    reader = ImageInputs(path, vision[1])
    images = reader.prepare([_png(10 + i, ((20, 28), (26, 18))[i]) for i in range(count)])
    text = [5, 17, 3, IMAGE, 41, 9] + ([60, IMAGE, 2] if count == 2 else []) + [33, 71]
    ids, spans = reader.expand(text, images)
    assert [ids[s - 1] for s, _, _ in spans] == [VOCAB - 2] * count  # begin-of-image before each
    rows = [[(images[k], start, n) for start, n, k in spans]]
    ours, randint, multinomial, drafts = _our_run(loaded.params, loaded.config, EXACT, ids, 8, 7, vision=vision,
                                                  images=rows)
    seq, their_drafts = _reference(model, ids, images, spans, EXACT, randint, multinomial, 8)
    assert their_drafts == drafts
    assert seq == ids + ours.output_ids
    # the image matters: a different image changes the answer
    other = reader.prepare([_png(99, (20, 28))] * count)
    loop = RenoiseLoop(loaded.params, loaded.config, EXACT, vision=vision)
    changed = loop.generate([ids], [8], [7], images=[[(other[k], s, n) for s, n, k in spans]])[0]
    assert changed.output_ids != ours.output_ids

