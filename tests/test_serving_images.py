"""Images through a compiled serving artifact: `mxc generate ARTIFACT --images` against `mxc
generate MODELDIR --images` (itself checked against transformers in test_gemma3_vision.py and
test_mllama_parity.py), on the tiny models of those tests, compiled for this host with image
slots to spare (an empty slot must change nothing)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from artifact_builds import run_mxc  # noqa: E402
from test_mllama_parity import tiny  # noqa: E402,F401  (the tiny mllama and its parameters, a fixture)

NEW = 8


def _import(model, root):
    from mxc.compiler.hf.convert import import_hf

    model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "mxc")
    return root / "mxc"


def _compile(base, model_dir, batch: int, prompt_len: int, slots: int):
    artifact = base / "artifact"
    done = run_mxc(base, "compile", str(model_dir / "model.mspec"), "-t", "local", "--serve", "--serve-batch",
                   str(batch), "--prompt-len", str(prompt_len), "--cache-len", str(prompt_len + NEW - 1),
                   "--images-per-row", str(slots), "--functions", "prefill,decode", "-o", str(artifact))
    assert done.returncode == 0, done.stderr[-3000:]
    return artifact


def _generate(base, model, inputs, *extra: str):
    """`mxc generate MODEL --prompt-tokens base/t.npy --images INPUTS` -> (tokens or None, the process)."""
    out = base / "g.npy"
    out.unlink(missing_ok=True)
    done = run_mxc(base, "generate", str(model), "--prompt-tokens", str(base / "t.npy"), "--images", str(inputs),
                   "--max-new", str(NEW), "-o", str(out), *extra)
    return (np.load(out) if done.returncode == 0 else None), done


def _refused(done, message: str) -> None:
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_gemma3_artifact_generates_what_the_model_generates_with_images(tmp_path):
    from test_gemma3_vision import IMAGE, _prompt, _tiny_hf_model

    model_dir = _import(_tiny_hf_model(), tmp_path)
    # Two requests in one group: two images, and one image in a row padded to the same width.
    two, _, pixels_two = _prompt(2)
    one, _, pixels_one = _prompt(1)
    tokens = np.full((2, two.shape[1]), -1, np.int64)
    tokens[0], tokens[1, :one.shape[1]] = two[0], one[0]
    np.save(tmp_path / "t.npy", tokens)
    types = (tokens == IMAGE).astype(np.int64)
    np.savez(tmp_path / "in.npz", pixel_values=np.concatenate([pixels_two, pixels_one]), token_type_ids=types)
    expected, done = _generate(tmp_path, model_dir, tmp_path / "in.npz")
    assert expected is not None, done.stderr[-3000:]

    artifact = _compile(tmp_path, model_dir, 2, tokens.shape[1], 2)  # row 1 leaves a slot empty
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["run"]["serve_images"] == {"entry": "placeholder", "token": IMAGE, "tokens_per_image": 4,
                                               "slots": 2}
    shapes = {leaf["path"][1]: leaf["shape"] for leaf in manifest["functions"]["prefill"]["inputs"]
              if leaf["path"][0] == 3}
    assert shapes == {"pixel_values": [2, 2, 3, 28, 28], "image_mask": [2, 2]}
    from mxc.compiler.commands.artifact_summary import run_lines  # what mxc inspect prints

    assert "  images: 2 slot(s) per row, each image 4 placeholder tokens (299)" in run_lines(manifest["run"])
    params = ["--params", str(model_dir / "params")]
    ours, done = _generate(tmp_path, artifact, tmp_path / "in.npz", *params)
    assert ours is not None, done.stderr[-3000:]
    assert ours.tolist() == expected.tolist()

    # Text alone (every slot empty): teacher-forced accuracy of the artifact against the model, 100%.
    (tmp_path / "text.txt").write_text("It is a truth universally acknowledged, that a single man in possession "
                                       "of a good fortune, must be in want of a wife.")
    done = run_mxc(tmp_path, "eval", "accuracy", str(artifact), *params, "--text", str(tmp_path / "text.txt"),
                   "--tokenizer", "bytes", "--reference", str(model_dir), "--prefill", "16", "--decode", "7",
                   "--only", "accuracy", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["top1"] == 100.0

    np.savez(tmp_path / "cut.npz", pixel_values=pixels_two[:, :, :27])
    _refused(_generate(tmp_path, artifact, tmp_path / "cut.npz", *params)[1],
             "pixel_values must be [images, 3, 28, 28], got float32[2, 3, 27, 28]")
    # --image files: preprocessed with the artifact's spec and placed as --images would be.
    from test_image_preprocess import _png

    np.save(tmp_path / "t.npy", two)
    files = [arg for seed in (1, 2) for arg in ("--image", str(_png(tmp_path, 40, 30 + seed, "RGB", seed)))]

    def with_files(model, *extra):
        out = tmp_path / "f.npy"
        done = run_mxc(tmp_path, "generate", str(model), "--prompt-tokens", str(tmp_path / "t.npy"), *files,
                       "--max-new", str(NEW), "-o", str(out), *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        return np.load(out)

    assert with_files(artifact, *params).tolist() == with_files(model_dir).tolist()

    # The rest of the refusals, as the runtime checks them against the manifest (in process).
    from mxc.runtime.artifact_reader import read_manifest
    from mxc.runtime.serving_images import ImageSlotError, image_slots_of

    manifest = read_manifest(artifact)
    slots = image_slots_of(manifest, manifest.functions["prefill"])
    width = tokens.shape[1]
    three, _, pixels_three = _prompt(3)
    refusals = [({"pixel_values": pixels_two}, tokens,
                 "2 image(s) of 4 tokens need 8 placeholder tokens (299); the prompts have 12"),
                ({"pixel_values": pixels_three}, three,
                 "prompt row 0 holds 3 images; the artifact has 2 image slot(s) per row"),
                ({"pixel_values": pixels_two}, np.concatenate([two, [[9, 9, 9]]], axis=1),
                 f"prompt row 0 holds images and {width + 3} tokens; the artifact's prefill takes {width}"),
                ({"pixel_values": np.concatenate([pixels_two, pixels_one]), "token_type_ids": 1 - types}, tokens,
                 "token_type_ids must mark exactly the placeholder tokens")]
    for arrays, prompts, message in refusals:
        with pytest.raises(ImageSlotError, match=re.escape(message)):
            slots.place(arrays, prompts, width)


@pytest.mark.slow  # about 35 s under load; the in-process slot test below covers its prefill in the default suite
def test_mllama_artifact_generates_what_the_model_generates_with_images(tmp_path):
    from test_mllama_parity import _inputs
    from test_mllama_vision import _hf_model

    model_dir = _import(_hf_model(seed=1), tmp_path)
    tokens, pixels, ids, tile_mask, cross = _inputs(2)
    np.save(tmp_path / "t.npy", tokens)
    np.savez(tmp_path / "in.npz", pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=tile_mask,
             cross_attention_mask=cross)
    expected, done = _generate(tmp_path, model_dir, tmp_path / "in.npz")
    assert expected is not None, done.stderr[-3000:]

    artifact = _compile(tmp_path, model_dir, 1, tokens.shape[1], 3)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["run"]["serve_images"] == {"entry": "cross_attention", "token": 127, "tokens_per_image": 1,
                                               "slots": 3}
    params = ["--params", str(model_dir / "params")]
    ours, done = _generate(tmp_path, artifact, tmp_path / "in.npz", *params)
    assert ours is not None, done.stderr[-3000:]
    assert ours.tolist() == expected.tolist()

    np.savez(tmp_path / "bad.npz", pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=tile_mask,
             cross_attention_mask=cross[:, :-1])
    _refused(_generate(tmp_path, artifact, tmp_path / "bad.npz", *params)[1],
             "cross_attention_mask must be [1, 20, 2, 4], got [1, 19, 2, 4]")


def test_mllama_slots_prefill_and_decode_as_the_model_does(tiny):
    """In process, to the logits: the slot prefill (two images in three slots, the third empty) and
    three decode steps against serving_steps with the processor's arrays. Text before the first
    image sees every image the row holds, and no empty slot; with every slot empty the cross
    layers change nothing, as the model without images skips them."""
    import jax
    import jax.numpy as jnp

    from test_mllama_parity import _inputs

    from mxc.compiler.aot import image_slots, serving_image_inputs
    from mxc.compiler.lower.decode import serving_steps
    from mxc.runtime.serving_images import ImageSlots

    _, spec, params = tiny
    tokens, pixels, ids, tile_mask, cross = _inputs(2)
    width = tokens.shape[1]
    inputs = dict(pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=tile_mask, cross_attention_mask=cross)
    abstract = serving_image_inputs(spec, 1, width, image_slots(spec, 3))
    slots = ImageSlots("cross_attention", 127, 1, {name: (tuple(a.shape[1:]), a.dtype.name)
                                                   for name, a in abstract.items()})
    lengths = np.array([width], np.int32)

    def logits(steps, *images):
        prefill, decode = (jax.jit(step) for step in steps)
        out, cache = prefill(params, tokens.astype(np.int32), lengths, *images)
        rows = [np.asarray(out)]
        for token in (5, 9, 11):
            out, cache = decode(params, np.array([token], np.int32), cache)
            rows.append(np.asarray(out))
        return np.stack(rows)

    slotted = serving_steps(spec, 1, width + 3, dtype="float32", image_slots=True)
    given = {k: jnp.asarray(v) for k, v in inputs.items()}
    np.testing.assert_allclose(logits(slotted, slots.place(inputs, tokens, width)),
                               logits(serving_steps(spec, 1, width + 3, dtype="float32", images=given)),
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits(slotted, slots.empty(1)),
                               logits(serving_steps(spec, 1, width + 3, dtype="float32")), atol=1e-5, rtol=0)


@pytest.mark.slow  # about 60 s under load
def test_llama4_artifact_generates_what_the_model_generates_with_images(tmp_path):
    from test_llama4_vision import _hf_model
    from test_llama4_vision_parity import _prompt

    model_dir = _import(_hf_model(), tmp_path)
    tokens, pixels = _prompt(2)  # 42 tokens: the second image lies past the first 16-token chunk
    np.save(tmp_path / "t.npy", tokens)
    np.savez(tmp_path / "in.npz", pixel_values=pixels)
    expected, done = _generate(tmp_path, model_dir, tmp_path / "in.npz")
    assert expected is not None, done.stderr[-3000:]
    artifact = _compile(tmp_path, model_dir, 1, tokens.shape[1], 3)
    ours, done = _generate(tmp_path, artifact, tmp_path / "in.npz", "--params", str(model_dir / "params"))
    assert ours is not None, done.stderr[-3000:]
    assert ours.tolist() == expected.tolist()

