"""Gemma4Renoise (dllm_jax/decode/renoise.py, renoise_loop.py) against transformers' ``generate``.

Replay: transformers' ``generate`` runs with its ``torch.randint`` (initial canvas, re-noise tokens) and
``torch.multinomial`` (samples) calls answered by the draws our loop made, so both take the same random decisions;
then every step's argmax canvas and the final sequence must be the same (dense and windowed configs, several
prompts, several canvases). Seeded runs do not depend on the batch they run in.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dllm_jax.decode import renoise  # noqa: E402
from dllm_jax.decode.renoise_loop import RenoiseLoop  # noqa: E402
from dllm_jax.model.loader import load_model  # noqa: E402
from dllm_jax.testing.diffusion_gemma import write_tiny_diffusion_gemma  # noqa: E402

STEPS = 6
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12], [7, 7, 30, 4, 11]]


def test_config_keys_and_errors():
    rcfg = renoise.renoise_config({"max_denoising_steps": 12, "sampler_config": {"entropy_bound": 0.5},
                                   "temperature_schedule": {"t_min": 0.1, "t_max": 0.9}, "stability_threshold": 2,
                                   "seed": 3})
    assert rcfg == renoise.RenoiseConfig(12, 0.5, 0.1, 0.9, 2, 0.005)
    assert renoise.renoise_config({}, {"t_min": 0.2}).t_min == 0.2  # the model's generation defaults under options
    for bad, match in [({"max_denoising_steps": 0}, r"algorithm_config.max_denoising_steps"),
                       ({"sampler_config": {"entropy_bound": 0}}, r"sampler_config.entropy_bound"),
                       ({"sampler_config": 3}, r"sampler_config: must be a mapping"),
                       ({"temperature_schedule": {"t_min": 0.9, "t_max": 0.5}}, r"temperature_schedule.t_max"),
                       ({"stopping_config": {"stability_threshold": 1.5}}, r"stopping_config.stability_threshold"),
                       ({"confidence_threshold": -1}, r"confidence_threshold"),
                       ({"threshold": 0.9}, r"algorithm_config.threshold: unknown"),
                       ({"stopping_config": {"bogus": 1}}, r"stopping_config.bogus: unknown")]:
        with pytest.raises(ValueError, match=match):
            renoise.renoise_config(bad)


def test_acceptance_rule():
    entropy = jnp.asarray([[0.05, 0.5, 0.02, 0.04, 0.3], [2.0, 1.0, 3.0, 0.0, 0.0]])
    # sorted 0.02 0.04 0.05 0.3 0.5: cumsum - self = 0, .02, .06, .11, .41 -> the first three within 0.1
    np.testing.assert_array_equal(np.asarray(renoise.accept(entropy, 0.1)),
                                  [[True, False, True, True, False], [False, True, False, True, True]])


class _Replay:
    """Answers transformers' torch.randint / torch.multinomial with recorded draws, in order."""

    def __init__(self, randint, multinomial):
        self.randint, self.multinomial = list(randint), list(multinomial)

    @contextlib.contextmanager
    def patched(self):
        from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen

        real_randint, real_multinomial = torch.randint, torch.multinomial

        class _Torch:
            def __getattr__(self, name):
                return getattr(torch, name)

            def randint(_, *args, **kwargs):
                return torch.as_tensor(self.randint.pop(0), dtype=torch.long)

            def multinomial(_, probs, num_samples):
                return torch.as_tensor(self.multinomial.pop(0), dtype=torch.long).reshape(-1, 1)

        saved = gen.torch
        gen.torch = _Torch()
        try:
            yield
        finally:
            gen.torch = saved
            assert torch.randint is real_randint and torch.multinomial is real_multinomial


class _DraftRecorder:
    def __init__(self):
        self.drafts = []

    def put(self, value):
        pass

    def put_draft(self, value):
        self.drafts.append(value[0].tolist())

    def end(self):
        pass


def _our_run(params, cfg, rcfg, prompt, max_new, seed, *, vision=None, images=None):
    loop = RenoiseLoop(params, cfg, rcfg, vision=vision)
    randint, multinomial, drafts = [], [], []
    canvases_seen = set()

    def on_step(c, state, draws):
        sample, noise, _ = draws
        if c not in canvases_seen:
            canvases_seen.add(c)
            init = renoise.initial_state(cfg, rcfg, jnp.asarray([seed], jnp.uint32), jnp.asarray([c]), jnp.float32)
            randint.append(np.asarray(init.canvas))
        multinomial.append(np.asarray(sample))
        randint.append(np.asarray(noise))
        drafts.append(np.asarray(state.argmax)[0].tolist())

    result = loop.generate([prompt], [max_new], [seed], on_step=on_step, images=images)[0]
    return result, randint, multinomial, drafts


@pytest.mark.parametrize("name, kwargs", [("dense_window_longer", dict(sliding_window=64)),
                                          ("windowed", dict(sliding_window=3, tie=False))])
def test_replay_equals_transformers(tmp_path, name, kwargs):
    model = write_tiny_diffusion_gemma(tmp_path, canvas_length=4, **kwargs)
    loaded = load_model(tmp_path)
    cfg, params = loaded.config, loaded.params
    rcfg = renoise.RenoiseConfig(max_denoising_steps=STEPS)
    for i, prompt in enumerate(PROMPTS):
        ours, randint, multinomial, drafts = _our_run(params, cfg, rcfg, prompt, 12, seed=100 + i)
        recorder = _DraftRecorder()
        with _Replay(randint, multinomial).patched():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, max_denoising_steps=STEPS,
                                 t_min=rcfg.t_min, t_max=rcfg.t_max, stability_threshold=rcfg.stability_threshold,
                                 confidence_threshold=rcfg.confidence_threshold,
                                 sampler_config=_sampler(rcfg.entropy_bound), streamer=recorder)
        assert recorder.drafts == drafts  # every step's argmax canvas
        assert out.sequences[0].tolist() == prompt + ours.output_ids
        assert ours.steps_per_canvas == [STEPS] * 3 and ours.finish_reason == "length"


def _sampler(bound):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    return EntropyBoundSamplerConfig(entropy_bound=bound)


def test_seeded_rows_do_not_depend_on_their_batch(tmp_path):
    write_tiny_diffusion_gemma(tmp_path, canvas_length=4, sliding_window=3, num_hidden_layers=2,
                               layer_types=["sliding_attention", "full_attention"])
    loaded = load_model(tmp_path)
    loop = RenoiseLoop(loaded.params, loaded.config, renoise.RenoiseConfig(max_denoising_steps=STEPS))
    alone = [loop.generate([p], [8], [s])[0].output_ids for p, s in zip(PROMPTS, (1, 2))]
    together = loop.generate(PROMPTS[::-1], [8, 8], [2, 1])
    assert [r.output_ids for r in together[::-1]] == alone
