"""`mxc tokenize DATA.jsonl --model MODEL`: image-text records to a token file and its image sidecar
(runtime/tokenize_images.py), read back against what `write_image_tokens` writes for the same
texts and images, for the tiny Gemma 3 and the tiny mllama of the training tests (a model
directory and an .mspec)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from test_image_preprocess import _png  # noqa: E402

from mxc.runtime import image_preprocess as ip  # noqa: E402
from mxc.runtime.cli import main as runtime_main  # noqa: E402
from mxc.runtime.image_file import TiledImage, open_images, write_image_tokens  # noqa: E402
from mxc.runtime.image_file import sidecar_path  # noqa: E402
from mxc.runtime.token_file import open_tokens  # noqa: E402


def _word_tokenizer(path, size: int, special: dict):
    """A word-level tokenizer: w0..w{size-1}, the special tokens at their ids (they replace words)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size) if i not in special.values()}
    vocab.update(special)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in special])
    tokenizer.save(str(path))
    return tokenizer


def _ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _same_files(ours, reference):
    assert ours.read_bytes() == reference.read_bytes()  # header (tokenizer name, fingerprint) and ids
    for name in ("pixels.npy", "offsets.npy", "meta.json", "aspect_ratio_ids.npy"):
        a, b = sidecar_path(ours) / name, sidecar_path(reference) / name
        assert a.exists() == b.exists(), name
        if a.exists():
            assert a.read_bytes() == b.read_bytes(), name


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A model directory as import-hf writes one, as far as tokenize reads it: the spec (the tiny
    Gemma 3 of tests/test_multimodal_train.py) and the tokenizer."""
    from test_multimodal_train import BEGIN, END, EOD, PLACEHOLDER, TINY, VOCAB

    root = tmp_path_factory.mktemp("gemma")
    (root / "model.mspec").write_text(TINY)
    special = {"<eos>": EOD, "<start_of_image>": BEGIN, "<end_of_image>": END, "<image_soft_token>": PLACEHOLDER}
    return root, _word_tokenizer(root / "tokenizer.json", VOCAB, special)


def test_gemma3_records_write_what_write_image_tokens_writes(gemma_dir, tmp_path, capsys):
    """Two records with images (one with two), one without, and a text file: the marker expanded as
    Gemma3Processor writes it (begin, 4 soft tokens, end), each image as the tower's processor makes it."""
    from test_multimodal_train import BEGIN, END, EOD, PER_IMAGE, PLACEHOLDER, VOCAB

    model, tokenizer = gemma_dir
    files = [_png(tmp_path, 50, 70, "RGB"), _png(tmp_path, 40, 30, "RGBA", seed=1), _png(tmp_path, 25, 60, "P")]
    data = _jsonl(tmp_path / "data.jsonl", [
        {"text": "w15 w16 <start_of_image> w17", "images": [files[0].name]},
        {"text": "w18"},
        {"text": "<start_of_image> w19 <start_of_image>", "images": [files[1].name, str(files[2])]},
    ])
    (tmp_path / "more.txt").write_text("w20 w21")
    out = tmp_path / "pairs.bin"
    assert runtime_main(["tokenize", str(data), str(tmp_path / "more.txt"), "-o", str(out), "--model", str(model)]) == 0
    assert "4 documents, 3 images" in capsys.readouterr().err

    from mxc.compiler.hf.model_dir import load_spec

    tower = load_spec(str(model)).vision
    pixels = [ip.pixel_values(tower, f).pixels[0] for f in files]
    examples = [[_ids(tokenizer, "w15 w16"), pixels[0], _ids(tokenizer, "w17")], [_ids(tokenizer, "w18")],
                [pixels[1], _ids(tokenizer, "w19"), pixels[2]], [_ids(tokenizer, "w20 w21")]]
    reference = tmp_path / "reference.bin"
    write_image_tokens(reference, examples, vocab_size=VOCAB, eod_id=EOD, placeholder=PLACEHOLDER,
                       tokens_per_image=PER_IMAGE, begin=BEGIN, end=END, tokenizer="tokenizer.json")
    _same_files(out, reference)
    images = open_images(open_tokens(out))
    assert len(images) == 3 and images.offsets.tolist() == [3, 13, 20]


# ---------------------------------------------------------------- the tiny mllama (tests/test_mllama_train.py)


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    from test_mllama_train import EOD, IMAGE, TINY

    root = tmp_path_factory.mktemp("mllama")
    (root / "tiny.mspec").write_text(TINY)
    tokenizer = _word_tokenizer(root / "tokenizer.json", IMAGE + 1, {"<|end_of_text|>": EOD, "<|image|>": IMAGE})
    return f"{root / 'tiny.mspec'}:mllama-tiny", root / "tokenizer.json", tokenizer


def _mllama_records(tmp_path):
    files = [_png(tmp_path, 13, 20, "RGB"), _png(tmp_path, 30, 14, "RGB", seed=3), _png(tmp_path, 9, 9, "L")]
    records = [{"text": "<|image|><|image|> w3 w4 w5", "images": [f.name for f in files[:2]]},
               {"text": "w6 w7"},
               {"text": "w8 <|image|> w9 w10", "images": [files[2].name]}]
    return files, _jsonl(tmp_path / "data.jsonl", records)


def test_mllama_records_write_tiled_images_and_their_arrangements(mllama, tmp_path):
    from test_mllama_train import EOD, IMAGE, TILES

    from mxc.runtime.data import ImagePackedSequences
    from mxc.spec.load import load_model

    model, tokenizer_path, tokenizer = mllama
    files, data = _mllama_records(tmp_path)
    out = tmp_path / "pairs.bin"
    assert runtime_main(["tokenize", str(data), "-o", str(out), "--model", model, "--tokenizer", str(tokenizer_path)]) == 0

    tower = load_model(model).vision
    tiled = []
    for f in files:
        image = ip.pixel_values(tower, f)
        pixels = np.zeros((TILES, 3, 8, 8), np.float32)
        pixels[:len(image.pixels)] = image.pixels
        tiled.append(TiledImage(pixels, {(1, 1): 1, (1, 2): 2, (2, 1): 3}[(image.tile_rows, image.tile_cols)]))
    assert [t.aspect_ratio_id for t in tiled] == [2, 3, 1]  # wide, tall, square
    examples = [[tiled[0], tiled[1], _ids(tokenizer, "w3 w4 w5")], [_ids(tokenizer, "w6 w7")],
                [_ids(tokenizer, "w8"), tiled[2], _ids(tokenizer, "w9 w10")]]
    reference = tmp_path / "reference.bin"
    write_image_tokens(reference, examples, vocab_size=IMAGE + 1, eod_id=EOD, placeholder=IMAGE, tokens_per_image=1,
                       tokenizer="tokenizer.json")
    _same_files(out, reference)
    # what mxc run reads: rows of 4 tokens with 2 image slots, every image in one
    tokens = open_tokens(out)
    packed = ImagePackedSequences(tokens, open_images(tokens), 4, 2)
    rows = packed.rows(np.arange(packed.count))
    assert rows["image_mask"].sum() == 3 and sorted(rows["aspect_ratio_ids"][rows["image_mask"]].tolist()) == [1, 2, 3]


def test_bad_records_are_one_error(mllama, tmp_path, capsys):
    from runtime_support import MXC, cpu_env

    model, tokenizer_path, _ = mllama
    files, _ = _mllama_records(tmp_path)
    cases = {
        "bad.jsonl:2: cannot read": [{"text": "w1"}, {"text": "<|image|> w2", "images": ["missing.png"]}],
        ":1: the prompt has 2 image marker(s) '<|image|>' for 1 image(s)":
            [{"text": "<|image|> w2 <|image|>", "images": [files[0].name]}],
        ":1: 'images' must be a list": [{"text": "<|image|>", "images": files[0].name}],
    }
    for expected, records in cases.items():
        data = _jsonl(tmp_path / "bad.jsonl", records)
        code = runtime_main(["tokenize", str(data), "-o", str(tmp_path / "x.bin"), "--model", model,
                             "--tokenizer", str(tokenizer_path)])
        error = capsys.readouterr().err
        assert code != 0 and expected in error and "Traceback" not in error, error
    # without a tokenizer (bytes) there is no marker to find
    code = runtime_main(["tokenize", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.bin"), "--model", model])
    assert code != 0 and "images need the model's tokenizer" in capsys.readouterr().err
    # through the mxc command, as a user runs it: an exit status and no traceback
    _jsonl(tmp_path / "bad.jsonl", cases["bad.jsonl:2: cannot read"])
    done = subprocess.run([MXC, "tokenize", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.bin"), "--model",
                           model, "--tokenizer", str(tokenizer_path)], env=cpu_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "bad.jsonl:2: cannot read" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.bin").exists()


@pytest.mark.slow  # a cpu-8 compile of the tiny mllama and 2 steps: a few minutes under load
def test_mxc_run_trains_the_tiny_mllama_on_a_tokenized_file(mllama, tmp_path):
    from runtime_support import MXC, cpu_env, run_command

    model, tokenizer_path, _ = mllama
    files = [_png(tmp_path, 13, 20, "RGB"), _png(tmp_path, 30, 14, "RGB", seed=3), _png(tmp_path, 9, 9, "L")]
    records = [{"text": f"w{3 + i % 5} <|image|> w{10 + i % 7} w{20 + i % 3}", "images": [files[i % 3].name]}
               for i in range(40)]
    data = _jsonl(tmp_path / "data.jsonl", records)
    assert runtime_main(["tokenize", str(data), "-o", str(tmp_path / "pairs.bin"), "--model", model,
                         "--tokenizer", str(tokenizer_path)]) == 0
    done = subprocess.run([MXC, "compile", model, "--topology", "cpu-8", "--seq", "16", "--batch", "8",
                           "--pin", "data=8", "--images-per-row", "2", "--functions", "init,train_step",
                           "-o", str(tmp_path / "artifact")], env=cpu_env(8), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    done = subprocess.run(run_command(tmp_path / "artifact", tmp_path / "pairs.bin", tmp_path / "ckpt", steps=2),
                          env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def test_llama4_tiles_and_the_global_tile_are_one_sidecar_entry_each(tmp_path):
    """A 50x70 image on 56-pixel tiles of Llama 4's tower: 1x2 tiles and a global tile, each its own
    placeholder run; the written ids are the whole expanded text's tokenization."""
    from mxc.runtime.tokenize import load_tokenizer
    from mxc.runtime.tokenize_images import ImageRecords
    from mxc.spec.load import load_model

    tower = load_model("llama4-17b-16e").vision.model_copy(update={"image": 56})  # 4 tokens a tile
    entry = tower.entry
    special = {"<|end_of_text|>": 0, "<|image_start|>": entry.begin, "<|image_end|>": entry.end,
               "<|patch|>": entry.token, "<|tile_x_separator|>": 5, "<|tile_y_separator|>": 6, "<|image|>": 7}
    _word_tokenizer(tmp_path / "tokenizer.json", 40, special)
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    png = _png(tmp_path, 50, 70, "RGB")
    image = ip.pixel_values(tower, png)
    assert (image.tile_rows, image.tile_cols, len(image.pixels)) == (1, 2, 3)
    records = ImageRecords(tower, tokenizer)
    parts = records.parts("x.jsonl:1", "w10 <|image|> w11", [png])
    out = tmp_path / "pairs.bin"
    write_image_tokens(out, [parts], vocab_size=max(special.values()) + 1, eod_id=0, placeholder=entry.token,
                       tokens_per_image=4)
    tokens = open_tokens(out)
    expanded = ip.expand_image_markers("w10 <|image|> w11", tower, [image], records.token_text)
    assert np.asarray(tokens.tokens).tolist() == tokenizer.encode(expanded) + [0]
    images = open_images(tokens)
    np.testing.assert_array_equal(np.asarray(images.pixels), image.pixels)
    assert len(images) == 3 and np.asarray(tokens.tokens)[images.offsets - 1].tolist() == [entry.begin, 5, 7]
