"""`mxc import-gguf`: tiny GGUF files of every imported architecture, written as llama.cpp writes
them (tests/gguf_files.py), import to the logits of the transformers model they came from;
dequantization matches hand-decoded blocks and transformers' own decoder; unsupported
architectures and tensor types fail with one clear line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_files import MODELS, VOCAB, add_tensor, gguf_tensors, hf_model, write_gguf
from mxc.compiler.cli import main

TOLERANCE = 1e-4  # max abs difference relative to the largest |logit| (as the HF parity tests)


def relative_error(mine: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(mine - reference).max() / np.abs(reference).max())


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def mxc_logits(model_dir, tokens: np.ndarray, work) -> np.ndarray:
    np.save(work / "tokens.npy", tokens)
    assert main(["forward", str(model_dir), "--tokens", str(work / "tokens.npy"), "-o", str(work / "logits.npy")]) == 0
    return np.load(work / "logits.npy")


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_tiny_gguf_imports_to_the_models_logits(name, tmp_path):
    model = hf_model(name)
    path = write_gguf(tmp_path / f"{name}.gguf", name, model)
    assert main(["import-gguf", str(path), "-o", str(tmp_path / "out")]) == 0
    assert relative_error(mxc_logits(tmp_path / "out", TOKENS, tmp_path), hf_logits(model, TOKENS)) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "qwen3moe", "mistral", "qwen3", "gemma", "gemma3", "mixtral"])
def test_tiny_gguf_imports_to_the_models_logits_more_families(name, tmp_path):
    test_tiny_gguf_imports_to_the_models_logits(name, tmp_path)


@pytest.mark.slow
def test_llama3_rope_scaling_stored_as_rope_freqs(tmp_path):
    """Llama 3.1's scaling changes only the slow frequencies: the whole context is needed to see it."""
    from gguf_files import MAX_POS

    model = hf_model("llama3")
    path = write_gguf(tmp_path / "m.gguf", "llama3", model)
    assert main(["import-gguf", str(path), "-o", str(tmp_path / "out")]) == 0
    assert "scaling = llama3(factor = 8.0" in (tmp_path / "out" / "model.mspec").read_text()
    tokens = np.random.default_rng(5).integers(0, VOCAB, (1, MAX_POS))
    assert relative_error(mxc_logits(tmp_path / "out", tokens, tmp_path), hf_logits(model, tokens)) < TOLERANCE


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_transformers_reads_the_tiny_files_as_written(name, tmp_path):
    """The files' conventions (q/k permutation, Gemma's 1 + w norms) are llama.cpp's as
    transformers' GGUF loader undoes them: it reads the file back to the same model."""
    from transformers import AutoModelForCausalLM

    model = hf_model(name)
    write_gguf(tmp_path / "m.gguf", name, model)
    # Settings transformers' GGUF loader does not read from the file are given as they are.
    unread = {k: getattr(model.config, k) for k in ("query_pre_attn_scalar", "attn_logit_softcapping",
                                                     "final_logit_softcapping") if hasattr(model.config, k)}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32,
                                                  **unread).eval()
    assert relative_error(hf_logits(loaded, TOKENS), hf_logits(model, TOKENS)) < TOLERANCE


def test_quantized_file_imports_to_its_dequantized_values(tmp_path):
    """A Q8_0 file: the parameters are the dequantized blocks, so the logits match the model whose
    weights are those values (and differ from the unquantized model's)."""
    from mxc.compiler.gguf.file import read_gguf

    model = hf_model("llama")
    path = write_gguf(tmp_path / "q.gguf", "llama", model, tensor_type="Q8_0")
    assert main(["import-gguf", str(path), "-o", str(tmp_path / "out")]) == 0
    gguf = read_gguf(path)
    assert gguf.tensors["blk.0.attn_q.weight"].type_name == "Q8_0"
    exact = hf_model("llama")
    with torch.no_grad():  # the reference holds the values the blocks decode to
        for key, value in exact.state_dict().items():
            if value.ndim >= 2:
                value.copy_(torch.tensor(_roundtrip(value.numpy(), "Q8_0")))
    mine = mxc_logits(tmp_path / "out", TOKENS, tmp_path)
    assert relative_error(mine, hf_logits(exact, TOKENS)) < TOLERANCE
    assert relative_error(mine, hf_logits(model, TOKENS)) > TOLERANCE


@pytest.mark.slow
def test_a_float16_file_keeps_float16_parameters(tmp_path):
    model = hf_model("llama")
    path = write_gguf(tmp_path / "h.gguf", "llama", model, tensor_type="F16")
    assert main(["import-gguf", str(path), "-o", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "model.mspec").read_text()
    assert "param_dtype = float16" in text and "compute_dtype = float16" in text
    with torch.no_grad():  # the reference holds the float16-rounded matrices
        for value in model.state_dict().values():
            if value.ndim >= 2:
                value.copy_(value.half().float())
    assert relative_error(mxc_logits(tmp_path / "out", TOKENS, tmp_path), hf_logits(model, TOKENS)) < 1e-3


def _roundtrip(value: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(gguf.quants.quantize(value.astype(np.float32), qtype), qtype)


# ------------------------------------------------------------------ dequantization

def _hand_decoded(raw: np.ndarray, type_name: str) -> np.ndarray:
    """ggml-quants.c's dequantize_row_* for the legacy block types, block by block."""
    out = []
    for block in raw.reshape(-1, raw.shape[-1] // (raw.shape[-1] // _BLOCK_BYTES[type_name])).reshape(
            -1, _BLOCK_BYTES[type_name]):
        d = float(block[:2].view(np.float16)[0])
        if type_name == "Q8_0":
            out.append(d * block[2:].view(np.int8).astype(np.float32))
            continue
        if type_name in ("Q4_1", "Q5_1"):
            m, rest = float(block[2:4].view(np.float16)[0]), block[4:]
        else:
            m, rest = None, block[2:]
        if type_name in ("Q5_0", "Q5_1"):
            high_bits, nibbles = int(rest[:4].view(np.uint32)[0]), rest[4:]
        else:
            high_bits, nibbles = 0, rest
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4]).astype(np.int32)
        if type_name in ("Q5_0", "Q5_1"):
            q |= np.array([((high_bits >> j) & 1) << 4 for j in range(32)], np.int32)
        offset = {"Q4_0": 8, "Q5_0": 16}.get(type_name, 0)
        values = d * (q - offset)
        out.append(values + m if m is not None else values)
    return np.concatenate(out).astype(np.float32)


_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}


def _file_with(tmp_path, tensors: dict[str, tuple[str, np.ndarray]]):
    """A GGUF holding raw tensors: name -> (type name, data as gguf stores it)."""
    import gguf

    from mxc.compiler.gguf.file import read_gguf

    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for name, (type_name, data) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=None if type_name in ("F32", "F16") else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(tmp_path / "t.gguf")


@pytest.mark.parametrize("type_name", list(_BLOCK_BYTES))
def test_legacy_block_types_dequantize_as_hand_decoded(type_name, tmp_path):
    import gguf

    values = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    file = _file_with(tmp_path, {"w": (type_name, raw)})
    got = file.dequantized("w")
    assert got.shape == (4, 64)
    np.testing.assert_array_equal(got.reshape(-1), _hand_decoded(raw, type_name))
    assert np.abs(got - values).max() < {"Q8_0": 0.03}.get(type_name, 0.5)


K_QUANTS = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@pytest.mark.parametrize("type_name", list(K_QUANTS))
def test_k_quants_dequantize_as_transformers_decodes_them(type_name, tmp_path):
    """Random blocks (with finite fp16 scales) decode as transformers' own torch decoder does."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    import gguf

    size = K_QUANTS[type_name]
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (2, 2, size), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (2, 2, 2)).astype(np.float16).view(np.uint8)
    # Every K block ends in its fp16 super-block scale(s): d (and dmin before it, for Q2/Q4/Q5_K).
    tail = {"Q2_K": 4, "Q3_K": 2, "Q4_K": 4, "Q5_K": 4, "Q6_K": 2}[type_name]
    start = size - tail if type_name in ("Q2_K", "Q3_K", "Q6_K") else 0
    blocks[..., start:start + tail] = scales.reshape(2, 2, 4)[..., :tail]
    raw = blocks.reshape(2, 2 * size)
    file = _file_with(tmp_path, {"w": (type_name, raw)})
    mine = file.dequantized("w")
    reference = hf_dequantize(torch.tensor(raw.reshape(-1)), int(gguf.GGMLQuantizationType[type_name])).numpy()
    assert mine.shape == (2, 512) and np.isfinite(mine).all()
    np.testing.assert_allclose(mine.reshape(-1), reference, rtol=1e-6, atol=1e-6)


def test_float_types_are_read_exactly(tmp_path):
    import ml_dtypes

    values = np.random.default_rng(3).normal(size=(3, 8)).astype(np.float32)
    bf16 = values.astype(ml_dtypes.bfloat16)
    file = _file_with(tmp_path, {"a": ("F32", values), "b": ("F16", values.astype(np.float16)),
                                 "c": ("BF16", bf16.view(np.uint8))})
    np.testing.assert_array_equal(file.dequantized("a"), values)
    np.testing.assert_array_equal(file.dequantized("b"), values.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(file.dequantized("c"), bf16.astype(np.float32))


# ------------------------------------------------------------------ errors

def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mxc: error: ") and "Traceback" not in err
    return err


def test_unsupported_architecture_is_named(tmp_path, capsys):
    model = hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", model)
    data = path.read_bytes().replace(b"llama", b"phi3x", 1)  # general.architecture's value
    (tmp_path / "phi.gguf").write_bytes(data)
    assert main(["import-gguf", str(tmp_path / "phi.gguf"), "-o", str(tmp_path / "out")]) == 1
    err = _one_error_line(capsys)
    assert "architecture 'phi3x' is not imported" in err and "phi.gguf" in err
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_named(tmp_path, capsys):
    import gguf

    raw = np.random.default_rng(4).integers(0, 256, (2, 18), dtype=np.uint8)  # one IQ4_NL block per row
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["import-gguf", str(tmp_path / "iq.gguf"), "-o", str(tmp_path / "out")]) == 1
    err = _one_error_line(capsys)
    assert "blk.0.attn_q.weight has type IQ4_NL" in err and "iq.gguf" in err


def test_unknown_pre_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", "llama", hf_model("llama"), tokenizer_pre="martian")
    assert main(["import-gguf", str(path), "-o", str(tmp_path / "out")]) == 1
    assert "pre-tokenizer 'martian' (tokenizer.ggml.pre) is not imported" in _one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_a_file_without_tokenizer_imports_its_weights(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", "llama", hf_model("llama"), tokenizer_pre=None)
    assert main(["import-gguf", str(path), "-o", str(tmp_path / "out")]) == 0
    assert "the file holds no tokenizer: none written" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.mspec").is_file() and not (tmp_path / "out" / "tokenizer.json").exists()


def test_not_a_gguf_file(tmp_path, capsys):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    assert main(["import-gguf", str(tmp_path / "x.gguf"), "-o", str(tmp_path / "out")]) == 1
    assert "x.gguf: not a readable GGUF file" in _one_error_line(capsys)
