"""`mxc export-hf` writes a model directory's tokenizer files beside the weights, so an exported
checkpoint tokenizes in transformers and comes back through `mxc import-hf` with its tokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from gguf_files import hf_model, write_gguf
from mxc.compiler.cli import main
from mxc.compiler.hf.model_dir import TOKENIZER_FILES


def test_export_hf_brings_the_tokenizer_along(tmp_path, capsys):
    from transformers import AutoTokenizer

    gguf = write_gguf(tmp_path / "tiny.gguf", "llama", hf_model("llama"))
    assert main(["import-gguf", str(gguf), "-o", str(tmp_path / "model")]) == 0
    model = tmp_path / "model"
    assert main(["export-hf", str(model), "-o", str(tmp_path / "hf")]) == 0
    assert "tokenizer: tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    present = [name for name in TOKENIZER_FILES if (model / name).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(present)
    for name in present:
        assert (tmp_path / "hf" / name).read_bytes() == (model / name).read_bytes()

    text = "Mr. Bennet was so odd a mixture"
    ours = AutoTokenizer.from_pretrained(model)
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported(text)["input_ids"] == ours(text)["input_ids"] and len(ours(text)["input_ids"]) > 5

    assert main(["import-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "again")]) == 0
    for name in present:
        assert (tmp_path / "again" / name).read_bytes() == (model / name).read_bytes()
