"""Every zoo model resolves, and its parameter counts equal the reference implementation's."""

import json
from pathlib import Path

import pytest

from mxc.compiler.analysis import summarize
from mxc.spec import load_model, zoo_names

REFERENCE = Path(__file__).resolve().parent / "data" / "param_counts.json"


def _reference():
    entries = json.loads(REFERENCE.read_text())
    by_zoo = {e["zoo"]: e for e in entries if e["zoo"]}
    deepseek_mtp = next(e for e in entries if e["zoo"] is None and "MTP" in e["hf_class"])
    return by_zoo, deepseek_mtp


BY_ZOO, DEEPSEEK_MTP = _reference()
MAXTEXT_NAMES = sorted(BY_ZOO)


def test_zoo_has_every_reference_model():
    assert set(MAXTEXT_NAMES) <= set(zoo_names())
    for tiny in ("llama3-tiny", "moe-tiny", "mla-tiny"):
        assert tiny in zoo_names()


@pytest.mark.parametrize("name", MAXTEXT_NAMES)
def test_parameter_counts_match_reference(name):
    summary = summarize(load_model(name))
    ref = BY_ZOO[name]
    assert summary.total_params == ref["total_params"]
    expected_active = ref["active_params"] if ref["active_params"] is not None else ref["total_params"]
    assert summary.active_params == expected_active


def test_deepseek_v3_mtp_reported_separately():
    summary = summarize(load_model("deepseek3-671b"))
    assert summary.total_params + summary.mtp_params == DEEPSEEK_MTP["total_params"]
    assert summary.mtp_params > 0


def test_layer_patterns():
    assert [s.period for s in load_model("gemma3-1b").layers] == [
        ("local",) * 5 + ("global",), ("local",)]
    assert load_model("gemma3-1b").num_layers == 26
    assert load_model("deepseek3-671b").layer_kinds[:4] == ("dense", "dense", "dense", "moe")
    maverick = load_model("llama4-17b-128e").layer_kinds
    assert maverick[:4] == ("rope_dense", "rope_moe", "rope_dense", "nope_moe") and len(maverick) == 48


def test_training_flops_follow_maxtext_accounting():
    # Llama 3.1 8B at seq 4096: 6 x matmul weights (head included, embedding lookup not) plus
    # causal attention at half the sequence: 6 * S/2 * 2 * heads * head_dim per layer.
    spec = load_model("llama3.1-8b")
    s = summarize(spec, seq=4096)
    matmul = 8030261248 - 128256 * 4096 - (2 * 32 + 1) * 4096
    attention = 32 * 6 * 2048 * 2 * 32 * 128
    assert s.train_flops_per_token == pytest.approx(6 * matmul + attention, rel=1e-12)


def test_sliding_window_counts_only_the_window():
    full = summarize(load_model("mistral-7b"), seq=4096).attention_flops_per_token
    long = summarize(load_model("mistral-7b"), seq=32768).attention_flops_per_token
    # The window (4096) caps what a query sees: going 8x longer adds far less than 8x.
    assert long < 2 * full


def test_zoo_files_are_in_canonical_form():
    # The same check as `mxc fmt --check models/*.mspec`.
    from importlib import resources

    from mxc.spec.format import format_text

    for entry in resources.files("mxc.models").iterdir():
        if entry.name.endswith(".mspec"):
            text = entry.read_text()
            assert format_text(text, entry.name) == text, entry.name
