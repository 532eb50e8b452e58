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
from dllm_jax.model.vision import VisionConfig, image_features_jit  # noqa: E402
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


def _checkpoint(path, window):
    model = write_tiny_diffusion_gemma(path, canvas_length=4, tie=False, sliding_window=window, num_hidden_layers=2,
                                       layer_types=[SLIDING, FULL], use_bidirectional_attention="vision")
    loaded = load_model(path)
    vcfg = VisionConfig.from_model_dir(str(path))
    vision = (load_vision_params(str(path), vcfg, loaded.config.hidden_size, jnp.float32), vcfg)
    return str(path), model, loaded, vision


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # window 6 is shorter than an image (tens of tokens): an image token sees its whole image all the same
    return _checkpoint(tmp_path_factory.mktemp("dg_images"), 6)


@pytest.fixture(scope="module")
def engine_checkpoint(tmp_path_factory):
    # window 80, longer than an image (as the published 512 is longer than its 280 soft tokens): a cached prefix
    # may end inside an image
    return _checkpoint(tmp_path_factory.mktemp("dg_images_engine"), 80)


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


def _vision_config(**kw) -> VisionConfig:
    base = dict(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                patch_size=4, pooling_kernel_size=2, position_embedding_size=64, rope_theta=100.0, rms_norm_eps=1e-6,
                clipped_linears=False, standardize=False, image_token_id=IMAGE, boi_token_id=VOCAB - 2,
                eoi_token_id=VOCAB - 1, bidirectional=True)
    return VisionConfig(**{**base, **kw})


def test_images_in(tmp_path):
    """Every way of sending an image reads the same pixels (one digest); prompts expand as transformers' processor
    expands them; the prefix keys of image tokens are their image's digest; bad input names the field."""
    from PIL import Image

    from dllm_jax.engine.images import cache_keys

    (tmp_path / "preprocessor_config.json").write_text('{"max_soft_tokens": 70}')
    reader = ImageInputs(str(tmp_path), _vision_config())
    png = _png(3)
    file = tmp_path / "a.png"
    file.write_bytes(png)
    b64 = base64.b64encode(png).decode()
    same = reader.prepare([png, str(file), b64, "data:image/png;base64," + b64, Image.open(io.BytesIO(png))])
    assert len({img.digest for img in same}) == 1 and same[0].pixel_values.shape == (280, 48)
    jpeg = io.BytesIO()
    Image.open(io.BytesIO(_png(4))).save(jpeg, format="JPEG")
    a, b = reader.prepare([png, jpeg.getvalue()])
    assert a.digest != b.digest
    ids, spans = reader.expand([1, IMAGE, 2, IMAGE], [a, b])
    n, m = a.num_soft_tokens, b.num_soft_tokens
    assert ids == [1, VOCAB - 2] + [IMAGE] * n + [VOCAB - 1, 2, VOCAB - 2] + [IMAGE] * m + [VOCAB - 1]
    assert spans == ((2, n, 0), (5 + n, m, 1))
    keys = cache_keys(ids, [a, b], spans)
    assert keys[:2] == ids[:2] and keys[2:2 + n] == [a.digest] * n and keys[5 + n:5 + n + m] == [b.digest] * m
    for item, match in [(b"not an image", "image_data: not an image"),
                        (["http://example.com/a.png"], r"image_data\[0\]: http\(s\) URLs are not fetched"),
                        ("data:text/plain;base64,aGk=", "image_data: a data URL must be"),
                        ("%%%", "image_data: not an image"), ([png] * 17, "image_data: 17 images, at most 16"),
                        (3.5, "image_data: must be image bytes")]:
        with pytest.raises(ValueError, match=match):
            reader.prepare(item)
    with pytest.raises(ValueError, match=r"image_data: 1 image\(s\) but the prompt has 2 image token"):
        reader.expand([IMAGE, IMAGE], [a])


def test_chunks_keep_images_whole():
    """An encode chunk never cuts an image (it stops before it, or runs to its end); a cached prefix may end inside
    an image shorter than the window (the next chunk holds its rest), and stops before one as long as the window
    (bidirectional vision attention would read its first tokens beyond the window)."""
    from types import SimpleNamespace

    from dllm_jax.engine.canvases import Canvases
    from dllm_jax.engine.request import Request
    from dllm_jax.engine.sampling import SamplingParams
    from dllm_jax.model.gemma import FULL_KIND, SLIDING_KIND

    image = SimpleNamespace(digest=b"d")
    prompt = [7] * 18 + [IMAGE] * 40 + [8] * 30
    spans = ((18, 40, 0),)
    req = Request("r", prompt, SamplingParams.from_dict({}), 0, images=(image,), image_spans=spans,
                  prompt_keys=[7] * 18 + [b"d"] * 40 + [8] * 30)
    for window, cached in ((64, 48), (40, 16)):  # the image is shorter than the window / as long as it
        runner = SimpleNamespace(page_size=16, num_pages={FULL_KIND: 32, SLIDING_KIND: 32},
                                 vision=(None, _vision_config()))
        policy = Canvases(runner, canvas=4, window=window, max_running_requests=2, max_prefill_tokens=32)
        policy._kv_len[req] = 0
        assert policy._chunk_end(req) == 18  # stops before the image
        policy._kv_len[req] = 18
        assert policy._chunk_end(req) == 58 and policy._chunk_images(req, 40) == [(image, 0, 0, 40)]
        pages = policy.full.alloc(3)
        policy.index.insert(req.cache_keys[:48], pages, policy.sliding.alloc(3))
        full, _ = policy._match(req)
        assert len(full) * 16 == cached
        if cached == 48:  # the next chunk: the image's rest, then text
            policy._kv_len[req] = 48
            assert policy._chunk_end(req) == 80 and policy._chunk_images(req, 32) == [(image, 0, 30, 10)]
        other = Request("o", prompt, SamplingParams.from_dict({}), 0, images=(image,), image_spans=spans,
                        prompt_keys=[7] * 18 + [b"e"] * 40 + [8] * 30)
        assert len(policy._match(other)[0]) == 1  # another image: its text page only


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
    ours = np.asarray(image_features_jit(vparams, jnp.asarray(pixels), jnp.asarray(positions), vcfg=vcfg))
    ours = np.concatenate([ours[i, :img.num_soft_tokens] for i, img in enumerate(images)])
    np.testing.assert_allclose(ours, want.pooler_output.numpy(), rtol=0, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2])
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



@pytest.fixture(scope="module")
def engine(engine_checkpoint):
    path = engine_checkpoint[0]
    eng = dllm_jax.Engine(model_path=path, warmup=False, max_running_requests=2,
                          algorithm_config={"max_denoising_steps": EXACT.max_denoising_steps,
                                            "entropy_bound": EXACT.entropy_bound, "t_min": EXACT.t_min,
                                            "t_max": EXACT.t_max})
    yield eng
    eng.shutdown()


TEXT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 30, 4, 11, 7, 7, 19, IMAGE, 41, 9, 8]  # a page of text first


def _params(seed=3):
    return {"max_new_tokens": 8, "seed": seed, "ignore_eos": True}


@pytest.mark.slow
def test_engine_with_an_image(engine_checkpoint, engine, tmp_path):
    """Every way of sending an image gives the loop's answer; the same image reuses its pages, another does not."""
    path, _, loaded, vision = engine_checkpoint
    png = _png(21)
    reader = ImageInputs(path, vision[1])
    images = reader.prepare([png])
    ids, spans = reader.expand(TEXT, images)
    loop = RenoiseLoop(loaded.params, loaded.config, EXACT, vision=vision)
    want = loop.generate([ids], [8], [3], images=[[(images[0], spans[0][0], spans[0][1])]])[0].output_ids
    file = tmp_path / "image.png"
    file.write_bytes(png)
    b64 = base64.b64encode(png).decode()
    engine.flush_cache()
    outs = [engine.generate(input_ids=TEXT, image_data=item, sampling_params=_params())
            for item in (png, str(file), b64, "data:image/png;base64," + b64)]
    engine.scheduler.check_pages()
    assert [o["output_ids"] for o in outs] == [want] * 4
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    # the image's pages reused: five pages, the last ending inside the image (its rest encoded with the prompt's)
    assert cached == [0, 80, 80, 80] and spans[0][0] < 80 < sum(spans[0][:2])
    # another image after the same text: only the text's page is reused, and the answer is the other image's
    other = _png(22)
    other_images = reader.prepare([other])
    other_want = loop.generate([ids], [8], [3], images=[[(other_images[0], spans[0][0], spans[0][1])]])[0]
    out = engine.generate(input_ids=TEXT, image_data=[other], sampling_params=_params())
    assert out["meta_info"]["cached_tokens"] == 16 and out["output_ids"] == other_want.output_ids
    assert other_want.output_ids != want
    # the text alone (its image token an ordinary token, as transformers without pixel_values): no image pages
    plain = engine.generate(input_ids=ids, sampling_params=_params())
    assert plain["meta_info"]["cached_tokens"] == 16
    engine.scheduler.check_pages()
    # a batch: rows with different images encode together (one tower call), each answering as alone
    engine.flush_cache()
    outs = engine.generate(input_ids=[TEXT, TEXT], image_data=[other, png], sampling_params=[_params()] * 2)
    assert [o["output_ids"] for o in outs] == [other_want.output_ids, want]
    # two images in one prompt, and prompts chunked by 16 tokens (a chunk stops before an image, or holds all of it)
    two = TEXT + [3, IMAGE, 5]
    both = reader.prepare([png, other])
    ids2, spans2 = reader.expand(two, both)
    want2 = loop.generate([ids2], [8], [3], images=[[(both[k], s, n) for s, n, k in spans2]])[0].output_ids
    assert engine.generate(input_ids=two, image_data=[png, other], sampling_params=_params())["output_ids"] == want2
    chunked = dllm_jax.Engine(model_path=path, warmup=False, max_running_requests=2, max_prefill_tokens=16,
                              algorithm_config=engine.engine_config.algorithm_config)
    try:
        outs = chunked.generate(input_ids=[two, TEXT], image_data=[[png, other], png], sampling_params=[_params()] * 2)
        assert [o["output_ids"] for o in outs] == [want2, want]
        chunked.scheduler.check_pages()
    finally:
        chunked.shutdown()


@pytest.mark.slow
def test_images_over_tp2(engine_checkpoint, engine):
    """On a mesh (TP 2): the tower runs on one device and its soft tokens join the sharded encoder, replicated; a
    batch of two prompts with different images answers as on one device."""
    path = engine_checkpoint[0]
    kw = dict(input_ids=[TEXT, TEXT], image_data=[_png(21), _png(22)], sampling_params=[_params()] * 2)
    engine.flush_cache()
    want = [o["output_ids"] for o in engine.generate(**kw)]
    sharded = dllm_jax.Engine(model_path=path, warmup=False, max_running_requests=2, tensor_parallel_size=2,
                              algorithm_config=engine.engine_config.algorithm_config)
    try:
        assert [o["output_ids"] for o in sharded.generate(**kw)] == want
        sharded.scheduler.check_pages()
    finally:
        sharded.shutdown()


@pytest.mark.slow
def test_bad_images_name_the_field(engine, tmp_path):
    png = _png(5)
    cases = [(b"not an image", "image_data: not an image"),
             (["https://example.com/cat.png"], "image_data\\[0\\]: http\\(s\\) URLs are not fetched"),
             ("data:text/plain;base64,aGk=", "image_data: a data URL must be"),
             ([png] * 17, "image_data: 17 images, at most 16"),
             ([png, png], "image_data: 2 image\\(s\\) but the prompt has 1 image token"),
             (12, "image_data: must be image bytes")]
    for item, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.generate(input_ids=TEXT, image_data=item, sampling_params=_params())
    with pytest.raises(ValueError, match="image_data\\[1\\]: not an image"):
        engine.generate(input_ids=[TEXT, TEXT], image_data=[png, b"junk"], sampling_params=_params())
    with pytest.raises(ValueError, match="image_data: for a batch of 2 prompts"):
        engine.generate(input_ids=[TEXT, TEXT], image_data=png, sampling_params=_params())


@pytest.mark.slow
def test_server_images(tmp_path):
    """/generate ``image_data`` and OpenAI ``image_url`` parts (data URLs) answer as the engine does; http(s) URLs,
    local paths, non-images are 400s naming the field."""
    from fastapi.testclient import TestClient

    from dllm_jax.testing.tokenizer_files import write_gemma_tokenizer
    from serve import ServerSettings, create_app

    ids = write_gemma_tokenizer(str(tmp_path), images=True)
    write_tiny_diffusion_gemma(tmp_path, canvas_length=4, tie=False, sliding_window=80, num_hidden_layers=2,
                               layer_types=[SLIDING, FULL], vocab_size=408, use_bidirectional_attention="vision",
                               eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    assert ids["<|image|>"] == 405
    eng = dllm_jax.Engine(model_path=str(tmp_path), warmup=False, max_running_requests=2,
                          algorithm_config={"max_denoising_steps": 3})
    png = _png(31)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    params = {"max_new_tokens": 8, "seed": 5, "ignore_eos": True}
    text = "look at <|image|> and count"
    want = eng.generate(prompt=text, image_data=png, sampling_params=params)
    app = create_app(eng, ServerSettings(), own_engine=False)
    with TestClient(app, base_url="http://localhost") as client:
        out = client.post("/generate", json={"text": text, "image_data": url, "sampling_params": params}).json()
        assert out["output_ids"] == want["output_ids"] and out["meta_info"]["prompt_tokens"] > 40
        batch = client.post("/generate", json={"text": [text, "plain text"], "image_data": [[url], None],
                                               "sampling_params": params}).json()
        assert batch[0]["output_ids"] == want["output_ids"]
        for body, param in [({"text": text, "image_data": "https://example.com/a.png"}, "image_data"),
                            ({"text": text, "image_data": str(tmp_path / "config.json")}, "image_data"),
                            ({"text": [text, text], "image_data": [url, "data:image/png;base64,AAAA"]},
                             "image_data[1]"),
                            ({"text": text, "image_data": [url, url]}, "image_data"),
                            ({"text": [text, text], "image_data": url}, "image_data")]:
            r = client.post("/generate", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.json())
        chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look at "},
                                                          {"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": " and count"}]}],
                "max_tokens": 8, "seed": 5}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 40, r.json()
        templated = eng.apply_chat_template([{"role": "user", "content": text}])
        ref = eng.generate(prompt=templated, image_data=png, sampling_params={**params, "ignore_eos": False})
        assert r.json()["choices"][0]["message"]["content"] == ref["text"]
        for part, param in [({"url": "https://example.com/a.png"}, "messages"),
                            ({"url": "data:image/png;base64,AAAA"}, "messages[0].content[1].image_url")]:
            bad = {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                     {"type": "image_url", "image_url": part}]}]}
            r = client.post("/v1/chat/completions", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.json()
            assert "image_url" in r.json()["error"]["message"]
    eng.shutdown()
