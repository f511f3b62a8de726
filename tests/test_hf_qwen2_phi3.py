"""Qwen2 (q/k/v biases, none on o) and Phi-3 (fused qkv_proj and gate_up_proj, LongRoPE) against
transformers, through the CLI: tiny random models built from configs here, float32 logits, greedy
decodes, and bit-for-bit export.

Phi-3's LongRoPE picks its factor set by the sequence's length: the short factors while it fits
original_max_position_embeddings (16 here), the long ones beyond. The logits are compared at 24
tokens (long) and at 12 (short); greedy decodes of 8 tokens run wholly below (prompt 6) and wholly
above (prompt 18), and one of 10 from a prompt of 12 crosses 16: transformers' generate then drops
its cache and recomputes the whole prefix with the long factors (Phi3ForCausalLM's
prepare_inputs_for_generation), as mxc's decode step does (compiler/lower/longrope_decode.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mxc.compiler.cli import main  # noqa: E402

from hf_parity_checks import (PROMPT, SEQ, TOLERANCE, VOCAB, check_features_bite,  # noqa: E402
                              check_logits_match, hf_generate, logits, relative_error, weight_files)

MIN_MARGIN = 1e-3
ORIGINAL = 16  # original_max_position_embeddings: PROMPT (12) < ORIGINAL < SEQ (24)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]  # head_dim 16: 8 rotary pairs
LONG = [1.2, 1.9, 3.0, 4.6, 7.0, 10.5, 15.0, 21.0]


def _longrope(short=SHORT, long=LONG) -> dict:
    return {"type": "longrope", "short_factor": list(short), "long_factor": list(long)}


@dataclass(frozen=True)
class Case:
    model: str
    config: str
    fields: dict
    decodes: tuple  # (prompt length, new tokens) of each greedy decode compared
    ablations: dict = field(default_factory=dict)


CASES = {
    "qwen2": Case("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=False), decodes=((PROMPT, 8),)),
    # Spelled as the hub's Phi-3 configs are: rope_scaling with "type", original_max_position_embeddings beside it.
    "phi3": Case("Phi3ForCausalLM", "Phi3Config",
                 dict(rope_scaling=_longrope(), original_max_position_embeddings=ORIGINAL, pad_token_id=0),
                 ablations={"longrope": dict(rope_scaling=None),
                            "long factors": dict(rope_scaling=_longrope(long=SHORT))},
                 # 14 tokens: short factors; 12 to 22 crosses 16 (transformers recomputes the prefix); 18 to 26: long
                 decodes=((6, 8), (PROMPT, 10), (ORIGINAL + 2, 8))),
}


def _hf_model(case: Case, **changes):
    config = getattr(transformers, case.config)(**{**COMMON, **case.fields, **changes})
    config._attn_implementation = "eager"
    return getattr(transformers, case.model)(config).eval()


@dataclass
class Built:
    case: Case
    model: object
    hf_dir: Path
    out_dir: Path
    work: Path
    tokens: np.ndarray
    decodes: list  # (prompt file, transformers' greedy sequences)


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory) -> Built:
    name = request.param
    case = CASES[name]
    torch.manual_seed(0)
    model = _hf_model(case)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and biases start as constants in HF; move them so a mix-up shows
        for param_name, p in model.named_parameters():
            if "norm" in param_name or param_name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    work = tmp_path_factory.mktemp(name)
    hf_dir = work / "hf"
    model.save_pretrained(hf_dir)
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (2, SEQ))
    np.save(work / "tokens.npy", tokens)
    decodes = []
    for length, new in case.decodes:
        for _ in range(20):
            prompt = rng.integers(1, VOCAB, (2, length))
            sequences, margin = hf_generate(model, prompt, new)
            if margin > MIN_MARGIN:
                break
        else:
            raise AssertionError("no prompt without near-ties in 20 draws")
        np.save(work / f"prompt{length}.npy", prompt)
        decodes.append((work / f"prompt{length}.npy", sequences))
    assert main(["import-hf", str(hf_dir), "-o", str(work / "out"), "--name", f"tiny-{name}"]) == 0
    return Built(case, model, hf_dir, work / "out", work, tokens, decodes)


def test_logits_match_transformers(built):
    check_logits_match(built)


@pytest.mark.parametrize("built", ["phi3"], indirect=True)
def test_short_sequence_logits_match_transformers(built):
    """Below original_max_position_embeddings: Phi-3's short factors."""
    short = built.tokens[:, :PROMPT]
    np.save(built.work / "short.npy", short)
    out = built.work / "short_logits.npy"
    assert main(["forward", str(built.out_dir), "--tokens", str(built.work / "short.npy"), "-o", str(out)]) == 0
    assert relative_error(np.load(out), logits(built.model, short)) < TOLERANCE


def test_features_bite(built):
    check_features_bite(built, _hf_model)


def test_greedy_generate_matches_transformers(built):
    for prompt, expected in built.decodes:
        out = built.work / f"generated_{prompt.stem}.npy"
        new = expected.shape[1] - np.load(prompt).shape[1]
        assert main(["generate", str(built.out_dir), "--prompt-tokens", str(prompt), "--max-new", str(new),
                     "--greedy", "-o", str(out)]) == 0
        np.testing.assert_array_equal(np.load(out), expected, err_msg=prompt.stem)


@pytest.mark.parametrize("built", ["phi3"], indirect=True)
def test_rows_crossing_original_max_at_different_steps_match_transformers(built):
    """Two prompts (10 and 14 tokens) decoded together cross 16 at different steps; each row's
    greedy tokens equal transformers' generate on that prompt alone (which recomputes its cache at
    the crossing)."""
    from mxc.compiler.commands.generate import spec_servable
    from mxc.compiler.hf.model_dir import load_spec_and_params
    from mxc.runtime.generate import PAD, generate

    spec, params = load_spec_and_params(str(built.out_dir))
    rng = np.random.default_rng(7)
    for _ in range(20):
        prompts = [rng.integers(1, VOCAB, (1, length)) for length in (10, 14)]
        expected = [hf_generate(built.model, prompt, 10) for prompt in prompts]
        if min(margin for _, margin in expected) > MIN_MARGIN:
            break
    batch = np.full((2, 14), PAD)
    for row, prompt in enumerate(prompts):
        batch[row, :prompt.shape[1]] = prompt[0]
    out, _ = generate(spec_servable(spec, 2, 14, 24, "float32"), params, batch, 10)
    for row, (sequence, _) in enumerate(expected):
        length = prompts[row].shape[1]
        np.testing.assert_array_equal(out[row, 14:], sequence[0, length:], err_msg=f"row {row}")


def test_export_reproduces_checkpoint_bit_for_bit(built):
    back = built.work / "exported"
    assert main(["export-hf", str(built.out_dir), "-o", str(back)]) == 0
    assert weight_files(back) == weight_files(built.hf_dir)
    assert (back / "config.json").read_bytes() == (built.hf_dir / "config.json").read_bytes()


def test_export_without_record_loads_in_transformers(built, tmp_path):
    """From the spec alone: a fresh config.json (Qwen2's, or Phi-3's with LongRoPE) that
    transformers reads as the same model, fused tensors included."""
    spec_only = tmp_path / "model"
    spec_only.mkdir()
    (spec_only / "model.mspec").write_text((built.out_dir / "model.mspec").read_text())
    exported = tmp_path / "hf"
    assert main(["export-hf", str(spec_only / "model.mspec"), "--params", str(built.out_dir / "params"),
                 "-o", str(exported)]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [built.case.model]
    reloaded = getattr(transformers, built.case.model).from_pretrained(exported, attn_implementation="eager",
                                                                      dtype=torch.float32).eval()
    assert relative_error(logits(reloaded, built.tokens), logits(built.model, built.tokens)) < TOLERANCE


def test_longrope_picks_the_factor_set_per_row_by_its_length():
    import jax.numpy as jnp

    from mxc.compiler.lower.rope import longrope_frequencies, rope_angles
    from mxc.spec.ir import LongRopeScaling, Rope

    rope = Rope(theta=10000.0, scaling=LongRopeScaling(short_factor=tuple(SHORT), long_factor=tuple(LONG),
                                                       original_max_seq=ORIGINAL, factor=4.0))
    short, long, attention_factor = longrope_frequencies(rope, 16)
    assert attention_factor == pytest.approx(np.sqrt(1 + np.log(4.0) / np.log(ORIGINAL)))
    # Row 0 reaches position 15 (16 tokens: short), row 1 position 16 (17 tokens: long).
    positions = jnp.stack([jnp.arange(16), jnp.arange(1, 17)])
    cos, _ = rope_angles(rope, 16, positions)
    np.testing.assert_allclose(cos[0, 3], np.cos(3 * short) * attention_factor, rtol=1e-6)
    np.testing.assert_allclose(cos[1, 2], np.cos(3 * long) * attention_factor, rtol=1e-6)


LONGROPE_SPEC = """model tiny-longrope {
  vocab = 300
  d_model = 64
  max_seq = 64
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  block x 2 {
    attention = mha(heads = 4, head_dim = 16,
                    rope = rope(theta = 10000,
                                scaling = longrope(short_factor = SHORT, long_factor = LONG,
                                                   original_max_seq = 16, factor = 4)))
    mlp = glu(hidden = 96, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}
"""


def test_longrope_lists_of_the_wrong_length_are_located_errors():
    from mxc.spec.diagnostics import SpecError
    from mxc.spec.load import load_text

    good = LONGROPE_SPEC.replace("SHORT", str(SHORT)).replace("LONG", str(LONG))
    assert len(load_text(good)["tiny-longrope"].blocks["block"].attention.rope.scaling.long_factor) == 8
    broken = LONGROPE_SPEC.replace("SHORT", str(SHORT)).replace("LONG", str(LONG[:7]))
    with pytest.raises(SpecError) as error:
        load_text(broken, "longrope.mspec")
    message = error.value.render()
    line = next(i for i, text in enumerate(broken.splitlines(), 1) if "long_factor" in text)
    column = broken.splitlines()[line - 1].index("long_factor") + 1
    assert f"longrope.mspec:{line}:{column}: error: longrope long_factor has 7 values; the rotary dimension " \
           "(16) needs 8, one per pair" in message


def _reference_rows() -> list[dict]:
    rows = json.loads((Path(__file__).resolve().parent / "data" / "param_counts.json").read_text())
    return [r for r in rows if r["hf_class"] in ("Qwen2ForCausalLM", "Phi3ForCausalLM")]


def test_zoo_configs_and_counts_agree_with_the_reference():
    """Each Qwen2.5 / Phi-3 zoo model exports a config.json of its class stating the reference's
    sizes, and the reference's config (on transformers' defaults) imports to its parameter count."""
    from mxc.compiler.analysis import summarize
    from mxc.compiler.hf.config_in import spec_from_config
    from mxc.compiler.hf.config_out import config_from_spec
    from mxc.spec.load import load_model

    rows = _reference_rows()
    assert {r["zoo"] for r in rows} == {"qwen2.5-7b", "qwen2.5-72b", "phi-3-mini-128k", "phi-3.5-mini"}
    for row in rows:
        config = config_from_spec(load_model(row["zoo"]))
        assert config["architectures"] == [row["hf_class"]], row["zoo"]
        assert {key: config.get(key) for key in row["config"]} == row["config"], row["zoo"]
        reference = getattr(transformers, row["hf_class"].replace("ForCausalLM", "Config"))(**row["config"])
        assert summarize(spec_from_config(reference.to_dict(), "m")).total_params == row["total_params"], row["zoo"]


def test_hub_spellings_of_phi3_configs_give_the_same_spec():
    """config.json as the hub's Phi-3 checkpoints have it (rope_scaling with type su or longrope,
    original_max_position_embeddings beside it, rope_theta apart) reads as transformers 5's
    rope_parameters spelling does."""
    from mxc.compiler.hf.config_in import spec_from_config

    hub = {**COMMON, "model_type": "phi3", "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0,
           "torch_dtype": "float32", "sliding_window": 48, "rms_norm_eps": 1e-5, "rope_scaling": _longrope()}
    saved = transformers.Phi3Config(**{k: v for k, v in hub.items() if k != "model_type"}).to_dict()
    expected = spec_from_config(saved, "m")
    scaling = expected.blocks[expected.layer_kinds[0]].attention.rope.scaling
    assert scaling.kind == "longrope" and scaling.original_max_seq == ORIGINAL and scaling.factor == 4.0
    assert expected.blocks[expected.layer_kinds[0]].attention.window == 48
    for kind in ("longrope", "su"):
        assert spec_from_config({**hub, "rope_scaling": {**_longrope(), "type": kind}}, "m") == expected, kind
