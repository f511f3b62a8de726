"""A tiny random Llama 3.2 Vision (MllamaForConditionalGeneration) against transformers: float32
logits with one and two images, and greedy decoding of 8 tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_mllama_vision import TEXT, VISION, _hf_model  # noqa: E402

from mxc.compiler.hf.mllama import canonical_names, spec_from_config, tensor_maps  # noqa: E402
from mxc.compiler.lower import cross_attention  # noqa: E402
from mxc.compiler.lower.decode import init_cache  # noqa: E402
from mxc.compiler.lower.param_def import is_def  # noqa: E402
from mxc.compiler.lower.params import param_defs  # noqa: E402

pytestmark = pytest.mark.slow  # about 150 s under load

IMAGE = 127  # the image token; the text model's table has 8 rows past the 128-token vocabulary


@pytest.fixture(scope="module")
def tiny():
    model = _hf_model(seed=1)
    spec = spec_from_config(model.config.to_dict(), "tiny", "float32")
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = canonical_names(state)
    state = {names.get(k, k): v for k, v in state.items()}
    params = jax.tree.map(lambda d: np.zeros(d.shape, np.float32), param_defs(spec), is_leaf=is_def)
    maps = list(tensor_maps(spec))
    assert sorted(m.hf_name for m in maps) == sorted(state)
    for tensor_map in maps:
        tensor_map.write(params, state[tensor_map.hf_name])
    for tensor_map in maps:
        np.testing.assert_array_equal(tensor_map.read(params), state[tensor_map.hf_name])
    return model, spec, jax.tree.map(jnp.asarray, params)


def _inputs(images: int):
    """A prompt of 20 tokens: text, an image token, text (a second image token at 10), as the
    processor writes them, with the mask each token's row gets (transformers' convention: a token
    sees the images from its own image token on; the tiles an image has)."""
    rng = np.random.default_rng(images)
    tokens = rng.integers(3, 120, (1, 20))
    starts = [4, 10][:images]
    tokens[0, starts] = IMAGE
    pixels = rng.standard_normal((1, images, 4, 3, 16, 16)).astype(np.float32)
    ids = np.array([[6, 2][:images]])
    tile_mask = np.array([[[1, 1, 1, 1], [1, 1, 0, 0]][:images]])
    cross = np.zeros((1, 20, images, 4), np.int64)
    for i, start in enumerate(starts):
        cross[0, start:, i] = tile_mask[0, i]
    return tokens, pixels, ids, tile_mask, cross


def _hf_inputs(tokens, pixels, ids, tile_mask, cross):
    return dict(input_ids=torch.from_numpy(tokens), pixel_values=torch.from_numpy(pixels),
                aspect_ratio_ids=torch.from_numpy(ids), aspect_ratio_mask=torch.from_numpy(tile_mask),
                cross_attention_mask=torch.from_numpy(cross))


def _images(spec, params, pixels, ids, tile_mask, cross):
    return cross_attention.cross_images(spec, params, jnp.asarray(pixels), jnp.asarray(ids), jnp.asarray(tile_mask),
                                        jnp.asarray(cross), jnp.float32)


@pytest.mark.parametrize("images", [1, 2])
def test_logits_match_transformers(tiny, images):
    model, spec, params = tiny
    tokens, *rest = _inputs(images)
    with torch.no_grad():
        ref = model(**_hf_inputs(tokens, *rest)).logits.numpy()
    logits, _ = cross_attention.forward(spec, params, jnp.asarray(tokens), images=_images(spec, params, *rest),
                                        dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


def test_text_only_skips_the_image_layers(tiny):
    model, spec, params = tiny
    tokens = np.random.default_rng(5).integers(3, 120, (1, 12))
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    logits, _ = cross_attention.forward(spec, params, jnp.asarray(tokens), dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


def _greedy(spec, params, tokens, images: cross_attention.CrossImages, steps: int) -> list[int]:
    cache = init_cache(spec, 1, tokens.shape[1] + steps, jnp.float32)
    logits, cache = cross_attention.forward(spec, params, jnp.asarray(tokens), images=images, cache=cache,
                                            dtype=jnp.float32)
    out = [int(jnp.argmax(logits[0, -1]))]
    step_images = images.last_row()
    for _ in range(steps - 1):
        logits, cache = cross_attention.forward(spec, params, jnp.asarray([[out[-1]]]), images=step_images,
                                                cache=cache, dtype=jnp.float32)
        out.append(int(jnp.argmax(logits[0, -1])))
    return out


@pytest.mark.parametrize("images", [1, 2])
def test_greedy_decode_matches_transformers(tiny, images):
    model, spec, params = tiny
    tokens, *rest = _inputs(images)
    with torch.no_grad():
        ref = model.generate(**_hf_inputs(tokens, *rest), max_new_tokens=8, do_sample=False)
    ours = _greedy(spec, params, tokens, _images(spec, params, *rest), 8)
    assert ours == ref[0, tokens.shape[1]:].tolist()


def test_import_and_export_are_bit_for_bit(tiny, tmp_path):
    from mxc.compiler.hf.convert import export_hf, import_hf
    from mxc.compiler.hf.model_dir import load_spec_and_params

    model, spec, params = tiny
    model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mxc")
    imported_spec, imported = load_spec_and_params(str(tmp_path / "mxc"))
    assert imported_spec.model_copy(update={"name": "tiny"}) == spec
    for ours, theirs in zip(jax.tree.leaves(imported), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    export_hf(imported_spec, imported, tmp_path / "back", tmp_path / "mxc")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert type(config).__name__ == "MllamaConfig" and config.text_config.cross_attention_layers == [1, 3]


def test_forward_and_generate_cli_take_the_processor_inputs(tiny, tmp_path):
    import os
    import subprocess
    import sys

    from mxc.compiler.hf.convert import import_hf

    model, _, _ = tiny
    model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mxc")
    tokens, pixels, ids, tile_mask, cross = _inputs(2)
    np.save(tmp_path / "t.npy", tokens)
    inputs = dict(pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=tile_mask, cross_attention_mask=cross)
    np.savez(tmp_path / "in.npz", **inputs)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def mxc(*args):
        return subprocess.run([sys.executable, "-m", "mxc.compiler.cli", *args], capture_output=True, text=True, env=env)

    run = mxc("forward", str(tmp_path / "mxc"), "--tokens", str(tmp_path / "t.npy"), "--images",
              str(tmp_path / "in.npz"), "-o", str(tmp_path / "l.npy"))
    assert run.returncode == 0, run.stderr
    with torch.no_grad():
        hf = _hf_inputs(tokens, pixels, ids, tile_mask, cross)
        ref = model(**hf).logits.numpy()
        ref_tokens = model.generate(**hf, max_new_tokens=8, do_sample=False)[0, tokens.shape[1]:].tolist()
    np.testing.assert_allclose(np.load(tmp_path / "l.npy"), ref, atol=1e-4, rtol=0)
    run = mxc("generate", str(tmp_path / "mxc"), "--prompt-tokens", str(tmp_path / "t.npy"), "--images",
              str(tmp_path / "in.npz"), "--max-new", "8", "-o", str(tmp_path / "g.npy"))
    assert run.returncode == 0, run.stderr
    generated = np.load(tmp_path / "g.npy")
    assert generated.reshape(-1)[-8:].tolist() == ref_tokens
    np.savez(tmp_path / "bad.npz", **{k: v for k, v in inputs.items() if k != "aspect_ratio_ids"})
    bad = mxc("forward", str(tmp_path / "mxc"), "--tokens", str(tmp_path / "t.npy"), "--images",
              str(tmp_path / "bad.npz"), "-o", str(tmp_path / "l.npy"))
    assert bad.returncode != 0 and "missing aspect_ratio_ids" in bad.stderr and "Traceback" not in bad.stderr
