"""Numerical parity with HuggingFace transformers for the dense families, through the CLI.

Each case builds a tiny randomly initialised HF model from a config object (no download), saves
it, and runs `mxc import-hf`, `mxc forward`, `mxc generate --greedy` and `mxc export-hf` in
process. The models are made to catch bugs: weights drawn with std 0.1, noise on every norm
weight and bias (which HF starts as constants), soft-caps small enough to bite, windows shorter
than the sequence; `test_features_bite` checks that each such feature changes the logits by far
more than the tolerance, and a prompt whose greedy steps come near a tie is redrawn.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mxc.compiler.cli import main  # noqa: E402

from hf_parity_checks import (PROMPT, SEQ, TOLERANCE, VOCAB, check_features_bite,  # noqa: E402
                              check_greedy_generate, check_logits_match)
from hf_parity_checks import hf_generate as _hf_generate  # noqa: E402
from hf_parity_checks import logits as _logits  # noqa: E402
from hf_parity_checks import relative_error as _relative_error  # noqa: E402
from hf_parity_checks import weight_files as _weight_files  # noqa: E402
MIN_MARGIN = 1e-3  # redraw prompts whose greedy top-2 logits come closer than this
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)


@dataclass(frozen=True)
class Case:
    model: str  # transformers class names
    config: str
    fields: dict
    # Config changes that must each change the logits (proof that the feature is exercised).
    ablations: dict = field(default_factory=dict)
    hub_spelling: bool = False  # write config.json as the hub does (rope_theta, rope_scaling, torch_dtype)
    bf16_shards: str | None = None  # save in bfloat16, sharded at this size
    biases: bool = False


CASES = {
    "llama": Case("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True, mlp_bias=True,
                                                          num_key_value_heads=4), biases=True),
    "llama3_rope": Case("LlamaForCausalLM", "LlamaConfig",
                        dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=16)),
                        ablations={"llama3 scaling": dict(rope_parameters=dict(rope_type="default",
                                                                               rope_theta=10000.0))},
                        hub_spelling=True),
    "mistral": Case("MistralForCausalLM", "MistralConfig", dict(sliding_window=6),
                    ablations={"window": dict(sliding_window=None)}, hub_spelling=True),
    "gemma": Case("GemmaForCausalLM", "GemmaConfig", dict(num_key_value_heads=1)),
    "gemma2": Case("Gemma2ForCausalLM", "Gemma2Config",
                   dict(sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                        query_pre_attn_scalar=24),
                   ablations={"window": dict(sliding_window=4096),
                              "attention softcap": dict(attn_logit_softcapping=None),
                              "final softcap": dict(final_logit_softcapping=None),
                              "query_pre_attn_scalar": dict(query_pre_attn_scalar=16)}),
    "gemma3": Case("Gemma3ForCausalLM", "Gemma3TextConfig",
                   dict(sliding_window=6, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=100000.0),
                                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
                   ablations={"window": dict(sliding_window=4096),
                              "global rope": dict(rope_parameters={
                                  "full_attention": dict(rope_type="default", rope_theta=10000.0),
                                  "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})},
                   hub_spelling=True),
    "qwen3": Case("Qwen3ForCausalLM", "Qwen3Config", dict(tie_word_embeddings=True), bf16_shards="60KB"),
}


def _hf_model(case: Case, **changes):
    config = getattr(transformers, case.config)(**{**COMMON, **case.fields, **changes})
    config._attn_implementation = "eager"
    return getattr(transformers, case.model)(config).eval()


def _hub_spelling(cfg: dict) -> dict:
    """config.json as older checkpoints on the hub spell it."""
    cfg = dict(cfg)
    cfg["torch_dtype"] = cfg.pop("dtype")
    rope = cfg.pop("rope_parameters")
    if "full_attention" in rope:  # Gemma 3: the global rope, the local base, and the layer pattern
        full, local = dict(rope["full_attention"]), rope["sliding_attention"]
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_local_base_freq"] = local["rope_theta"]
        cfg["rope_scaling"] = full if full["rope_type"] != "default" else None
        types = cfg.pop("layer_types")
        cfg.pop("_sliding_window_pattern", None)
        pattern = types.index("full_attention") + 1
        assert types == ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(types))]
        cfg["sliding_window_pattern"] = pattern
    else:
        rope = dict(rope)
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    return cfg


def _perturb(model) -> None:
    """Norm weights and biases start as constants in HF; move them so a mix-up shows."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=generator))


@dataclass
class Built:
    case: Case
    model: object  # the HF model, float32, with the weights exactly as saved
    hf_dir: Path
    out_dir: Path
    work: Path
    tokens: np.ndarray
    prompt: np.ndarray
    hf_sequences: np.ndarray


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory) -> Built:
    name = request.param
    case = CASES[name]
    torch.manual_seed(0)
    model = _hf_model(case)
    _perturb(model)
    work = tmp_path_factory.mktemp(name)
    hf_dir = work / "hf"
    if case.bf16_shards:
        # The reference computes in float32 on the bfloat16-rounded weights (and float32 rope tables).
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(hf_dir, max_shard_size=case.bf16_shards)
    else:
        model.save_pretrained(hf_dir)
    if case.hub_spelling:
        cfg = _hub_spelling(json.loads((hf_dir / "config.json").read_text()))
        (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        # The rewritten file must mean the same model to transformers itself.
        reread = transformers.AutoConfig.from_pretrained(hf_dir)
        assert reread.rope_parameters == model.config.rope_parameters
        assert getattr(reread, "layer_types", None) == getattr(model.config, "layer_types", None)
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (2, SEQ))
    for _ in range(20):
        prompt = rng.integers(1, VOCAB, (2, PROMPT))
        sequences, margin = _hf_generate(model, prompt)
        if margin > MIN_MARGIN:
            break
    else:
        raise AssertionError("no prompt without near-ties in 20 draws")
    np.save(work / "tokens.npy", tokens)
    np.save(work / "prompt.npy", prompt)
    assert main(["import-hf", str(hf_dir), "-o", str(work / "out"), "--name", f"tiny-{name}"]) == 0
    return Built(case, model, hf_dir, work / "out", work, tokens, prompt, sequences)


def test_logits_match_transformers(built):
    check_logits_match(built)


def test_features_bite(built):
    check_features_bite(built, _hf_model)


def test_greedy_generate_matches_transformers(built):
    check_greedy_generate(built)


def test_export_reproduces_checkpoint_bit_for_bit(built):
    back = built.work / "exported"
    assert main(["export-hf", str(built.out_dir), "-o", str(back)]) == 0
    original = _weight_files(built.hf_dir)
    if built.case.bf16_shards:
        assert "model.safetensors.index.json" in original and len(original) > 2
    assert _weight_files(back) == original
    assert (back / "config.json").read_bytes() == (built.hf_dir / "config.json").read_bytes()


def test_export_without_record_loads_in_transformers(built, tmp_path):
    """A model directory with no recorded HF files (as after training from a spec) exports a fresh
    config.json that transformers reads as the same model."""
    spec_only = tmp_path / "model"
    spec_only.mkdir()
    (spec_only / "model.mspec").write_text((built.out_dir / "model.mspec").read_text())
    exported = tmp_path / "hf"
    assert main(["export-hf", str(spec_only / "model.mspec"), "--params", str(built.out_dir / "params"),
                 "-o", str(exported)]) == 0
    reloaded = getattr(transformers, built.case.model).from_pretrained(exported, attn_implementation="eager",
                                                                      dtype=torch.float32).eval()
    assert _relative_error(_logits(reloaded, built.tokens), _logits(built.model, built.tokens)) < TOLERANCE


@pytest.mark.parametrize("built", ["gemma2"], indirect=True)
def test_generate_samples_reproducibly_from_the_command_line(built, capsys):
    def run(*flags):
        out = built.work / f"sampled{'_'.join(flags)}.npy"
        code = main(["generate", str(built.out_dir), "--prompt-tokens", str(built.work / "prompt.npy"),
                     "--max-new", "8", "-o", str(out), *flags])
        return code, (np.load(out) if code == 0 else None)

    code, first = run("--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "3")
    assert code == 0 and first.shape == (2, PROMPT + 8) and first.max() < VOCAB
    np.testing.assert_array_equal(first[:, :PROMPT], built.prompt)
    assert np.array_equal(run("--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "3")[1], first)
    assert not np.array_equal(run("--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "4")[1],
                              first)
    capsys.readouterr()
    assert run("--greedy", "--temperature", "0.5")[0] == 1
    assert "cannot be combined with --temperature" in capsys.readouterr().err
    assert run("--top-p", "1.5")[0] == 1
    assert "--top-p must lie in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("built", ["gemma2"], indirect=True)
def test_command_line_mistakes_are_messages(built, tmp_path, capsys):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([[1, VOCAB]]))
    assert main(["forward", str(built.out_dir), "--tokens", str(bad), "-o", str(tmp_path / "x.npy")]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["forward", "llama3-tiny", "--tokens", str(bad), "-o", str(tmp_path / "x.npy")]) == 1
    assert "--params" in capsys.readouterr().err
    multimodal = tmp_path / "multimodal"
    shutil.copytree(built.hf_dir, multimodal)
    cfg = json.loads((multimodal / "config.json").read_text())
    (multimodal / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3"}))
    assert main(["import-hf", str(multimodal), "-o", str(tmp_path / "out")]) == 1
    assert "gemma3_text" in capsys.readouterr().err
    (multimodal / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5,
                                                        "layer_types": cfg["layer_types"] + ["full_attention"]}))
    assert main(["import-hf", str(multimodal), "-o", str(tmp_path / "out")]) == 1
    assert "no tensor model.layers.4." in capsys.readouterr().err


def test_layer_patterns_become_repeating_segments():
    from mxc.compiler.hf.config_in import segments

    gemma3_1b = (["local"] * 5 + ["global"]) * 4 + ["local"] * 2
    assert [(s.period, s.repeat) for s in segments(gemma3_1b)] == [(("local",) * 5 + ("global",), 4),
                                                                   (("local",), 2)]
    assert [(s.period, s.repeat) for s in segments(["local", "global"] * 13)] == [(("local", "global"), 13)]
    assert [(s.period, s.repeat) for s in segments(["block"] * 7)] == [(("block",), 7)]
    assert [(s.period, s.repeat) for s in segments(["a", "a", "b", "a"])] == [(("a",), 2), (("b",), 1), (("a",), 1)]


def test_both_config_spellings_give_the_same_spec():
    from mxc.compiler.hf.config_in import spec_from_config

    for name in ("llama3_rope", "gemma3", "mistral"):
        config = _hf_model(CASES[name]).config.to_dict()
        assert spec_from_config(_hub_spelling(config), "m") == spec_from_config(config, "m"), name


REFERENCE = Path(__file__).resolve().parent / "data" / "param_counts.json"
FAMILY_CLASSES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                  "Gemma2ForCausalLM", "Gemma3ForCausalLM"}


def _reference_dense_models() -> list[dict]:
    entries = json.loads(REFERENCE.read_text())
    return [e for e in entries if e["zoo"] and e["hf_class"] in FAMILY_CLASSES]


def test_exported_configs_agree_with_the_reference_configs():
    """config.json written for each dense zoo model states the sizes the reference configs state."""
    from mxc.compiler.hf.config_out import config_from_spec
    from mxc.spec.load import load_model

    entries = _reference_dense_models()
    assert len(entries) >= 20
    for entry in entries:
        config = config_from_spec(load_model(entry["zoo"]))
        assert config["architectures"] == [entry["hf_class"]], entry["zoo"]
        for key, value in entry["config"].items():
            assert config.get(key, value if key == "mlp_bias" else None) == value, (entry["zoo"], key)


def test_imported_real_configs_have_the_reference_parameter_counts():
    """config.json of each real model (the reference's fields on transformers' defaults) imports to
    a spec whose parameter count is the one transformers counts."""
    from mxc.compiler.analysis import summarize
    from mxc.compiler.hf.config_in import spec_from_config

    for entry in _reference_dense_models():
        config_class = getattr(transformers, entry["hf_class"].replace("ForCausalLM", "Config").replace(
            "Gemma3Config", "Gemma3TextConfig"))
        config = config_class(**entry["config"]).to_dict()
        assert summarize(spec_from_config(config, "m")).total_params == entry["total_params"], entry["zoo"]
