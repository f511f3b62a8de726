"""Numerical parity with HuggingFace transformers for the mixture-of-experts families, through the CLI.

As test_hf_parity.py does for the dense families: a tiny randomly initialised HF model of each
family (Mixtral, Qwen3-MoE, GPT-OSS, Llama 4 text) is built from a config object, saved, and run
through `mxc import-hf`, `mxc forward` (the dropless expert path), `mxc generate --greedy` and
`mxc export-hf`. Weights are drawn with std 0.1 and every norm weight, bias and sink is moved off
its constant start; the routers must spread the test tokens over every expert of every MoE layer
(checked on the reference's own router logits), and each feature under test must move the logits
far beyond the tolerance when switched off.
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
                              check_greedy_generate, check_logits_match)
from hf_parity_checks import hf_generate as _hf_generate  # noqa: E402
from hf_parity_checks import logits as _logits  # noqa: E402
from hf_parity_checks import relative_error as _relative_error  # noqa: E402
from hf_parity_checks import weight_files as _weight_files  # noqa: E402
MIN_MARGIN = 1e-3  # redraw prompts whose greedy top-2 logits come closer than this
EXPERTS = 4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)


@dataclass(frozen=True)
class Case:
    model: str  # transformers class names
    config: str
    fields: dict
    # Config changes that must each change the logits (proof that the feature is exercised).
    ablations: dict = field(default_factory=dict)


CASES = {
    "mixtral": Case("MixtralForCausalLM", "MixtralConfig",
                    dict(intermediate_size=96, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=6),
                    ablations={"second expert": dict(num_experts_per_tok=1), "window": dict(sliding_window=None)}),
    # A dense first layer (mlp_only_layers), renormalised top-2 over the others.
    "qwen3_moe": Case("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                      dict(intermediate_size=96, moe_intermediate_size=48, num_experts=EXPERTS, num_experts_per_tok=2,
                           norm_topk_prob=True, mlp_only_layers=[0], attention_bias=True),
                      ablations={"top-k renormalisation": dict(norm_topk_prob=False)}),
    # A swiglu_limit small enough to clamp, YaRN over a short original context, a short window.
    "gpt_oss": Case("GptOssForCausalLM", "GptOssConfig",
                    dict(intermediate_size=48, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=6,
                         swiglu_limit=0.5,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=32.0,
                                              beta_slow=1.0, truncate=False, original_max_position_embeddings=16)),
                    ablations={"clamp": dict(swiglu_limit=7.0), "window": dict(sliding_window=4096),
                               "yarn": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))}),
    # Dense and MoE layers alternate; the fourth layer is NoPE with temperature tuning that
    # grows within the sequence; chunks shorter than the sequence.
    "llama4": Case("Llama4ForCausalLM", "Llama4TextConfig",
                   dict(intermediate_size=48, intermediate_size_mlp=96, num_local_experts=EXPERTS,
                        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=6, floor_scale=4,
                        attn_scale=0.5,
                        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=16)),
                   ablations={"chunk": dict(attention_chunk_size=4096),
                              "temperature tuning": dict(attn_temperature_tuning=False),
                              "qk norm": dict(use_qk_norm=False),
                              "llama3 scaling": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))}),
}


def _hf_model(case: Case, **changes):
    config = getattr(transformers, case.config)(**{**COMMON, **case.fields, **changes})
    config._attn_implementation = "eager"
    return getattr(transformers, case.model)(config).eval()


def _perturb(model) -> None:
    """Norm weights, biases and sinks start as constants in HF; move them so a mix-up shows."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(0.3 * torch.randn(p.shape, generator=generator))


@dataclass
class Built:
    case: Case
    model: object
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
    model.save_pretrained(hf_dir)
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


def test_routers_pick_every_expert(built):
    """The reference's own routing sends the test tokens to every expert of every MoE layer, and
    not to one expert for most tokens: a wrong expert mapping cannot hide."""
    with torch.no_grad():
        out = built.model(torch.tensor(built.tokens), output_router_logits=True)
    top_k = built.model.config.num_experts_per_tok
    assert len(out.router_logits) >= 2
    for layer, logits in enumerate(out.router_logits):
        chosen = torch.topk(logits.float(), top_k, dim=-1).indices.numpy().reshape(-1)
        load = np.bincount(chosen, minlength=EXPERTS)
        assert (load > 0).all() and load.max() < 0.7 * chosen.size, (layer, load)


def test_logits_match_transformers(built):
    check_logits_match(built)


def test_features_bite(built):
    check_features_bite(built, _hf_model)


def test_greedy_generate_matches_transformers(built):
    check_greedy_generate(built)


def test_export_reproduces_checkpoint_bit_for_bit(built):
    back = built.work / "exported"
    assert main(["export-hf", str(built.out_dir), "-o", str(back)]) == 0
    assert _weight_files(back) == _weight_files(built.hf_dir)
    assert (back / "config.json").read_bytes() == (built.hf_dir / "config.json").read_bytes()


def test_export_without_record_loads_in_transformers(built, tmp_path):
    """A fresh config.json written from the spec alone is read by transformers as the same model."""
    spec_only = tmp_path / "model"
    spec_only.mkdir()
    (spec_only / "model.mspec").write_text((built.out_dir / "model.mspec").read_text())
    exported = tmp_path / "hf"
    assert main(["export-hf", str(spec_only / "model.mspec"), "--params", str(built.out_dir / "params"),
                 "-o", str(exported)]) == 0
    reloaded = getattr(transformers, built.case.model).from_pretrained(exported, attn_implementation="eager",
                                                                      dtype=torch.float32).eval()
    assert _relative_error(_logits(reloaded, built.tokens), _logits(built.model, built.tokens)) < TOLERANCE


def test_hub_spelling_of_qwen3_moe_gives_the_same_spec():
    """Qwen3-MoE checkpoints on the hub name the expert count num_experts and the rope base
    rope_theta; transformers 5 writes num_local_experts and rope_parameters."""
    from mxc.compiler.hf.config_in import spec_from_config

    config = _hf_model(CASES["qwen3_moe"]).config.to_dict()
    hub = dict(config)
    hub["num_experts"] = hub.pop("num_local_experts")
    hub["rope_theta"] = hub.pop("rope_parameters")["rope_theta"]
    hub["torch_dtype"] = hub.pop("dtype")
    assert spec_from_config(hub, "m") == spec_from_config(config, "m")


def test_multimodal_llama4_without_its_text_sizes_is_a_config_error():
    # Llama4ForConditionalGeneration imports (tests/test_llama4_vision.py); a text_config without
    # its sizes is one clear error.
    from mxc.compiler.hf.config_in import ConfigError, spec_from_config

    with pytest.raises(ConfigError, match="text_config has no"):
        spec_from_config({"model_type": "llama4", "text_config": {}}, "m")


REFERENCE = Path(__file__).resolve().parent / "data" / "param_counts.json"
MOE_CLASSES = {"MixtralForCausalLM": "MixtralConfig", "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
               "GptOssForCausalLM": "GptOssConfig", "Llama4ForCausalLM": "Llama4TextConfig"}


def _reference_moe_models() -> list[dict]:
    return [e for e in json.loads(REFERENCE.read_text()) if e["zoo"] and e["hf_class"] in MOE_CLASSES]


def test_imported_real_configs_have_the_reference_parameter_counts():
    """config.json of each real MoE model imports to a spec with the parameter count transformers
    counts, and that spec exports back to a config with the same sizes."""
    from mxc.compiler.analysis import summarize
    from mxc.compiler.hf.config_in import spec_from_config
    from mxc.compiler.hf.config_out import config_from_spec
    from mxc.spec.ir import MoE

    entries = _reference_moe_models()
    assert len(entries) >= 8
    for entry in entries:
        config = getattr(transformers, MOE_CLASSES[entry["hf_class"]])(**entry["config"]).to_dict()
        spec = spec_from_config(config, "m")
        assert summarize(spec).total_params == entry["total_params"], entry["zoo"]
        written = config_from_spec(spec)
        all_moe = all(isinstance(b.mlp, MoE) for b in spec.blocks.values())
        # Without dense layers the spec does not say how wide they would be.
        undetermined = {"intermediate_size_mlp"} if entry["hf_class"] == "Llama4ForCausalLM" else {"intermediate_size"}
        for key, value in entry["config"].items():
            if key in written and not (all_moe and key in undetermined and written["model_type"] != "mixtral"):
                assert written[key] == value, (entry["zoo"], key)


@pytest.mark.parametrize("name, architecture", [
    ("mixtral-8x7b", "MixtralForCausalLM"), ("moe-tiny", "MixtralForCausalLM"),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM"), ("gpt-oss-120b", "GptOssForCausalLM"),
    ("llama4-17b-128e-text", "Llama4ForCausalLM")])
def test_zoo_moe_models_export_to_their_family(name, architecture):
    """A zoo model's config.json names its family and reads back, through transformers' own
    config class, as the same spec."""
    from mxc.compiler.hf.config_in import spec_from_config
    from mxc.compiler.hf.config_out import config_from_spec
    from mxc.spec.load import load_model

    spec = load_model(name)
    config = config_from_spec(spec)
    assert config["architectures"] == [architecture]
    config_class = getattr(transformers, MOE_CLASSES[architecture])
    reread = config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")}).to_dict()
    back = spec_from_config(reread, spec.name, spec.param_dtype)
    assert back == spec.model_copy(update={"compute_dtype": spec.param_dtype})
