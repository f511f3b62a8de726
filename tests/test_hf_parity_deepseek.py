"""Numerical parity with HuggingFace transformers for DeepSeek V2 and V3, through the CLI.

As test_hf_parity.py does for the dense families: a tiny randomly initialised HF model is built
from a config object, saved, and run through `mxc import-hf`, `mxc forward`, `mxc generate
--greedy` (prefill and decode over the latent cache, in the absorbed form) and `mxc export-hf`.
Weights are drawn with std 0.1, every norm weight, bias and correction bias is moved off its
constant start, the routers must spread the test tokens over every expert of every MoE layer
(checked on the reference's own choices), and each feature under test must move the logits far
beyond the tolerance when switched off.

transformers' DeepseekV3ForCausalLM carries no multi-token-prediction weights, but its MtpModel
runs DeepSeek's released MTP layout; the V3 checkpoint here gets one MTP module in that layout
(layer num_hidden_layers, with the copies of embedding and head), and the module's logits are
compared with MtpModel's.
"""

from __future__ import annotations

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

from hf_parity_checks import (BITES, PROMPT, SEQ, TOLERANCE, VOCAB, check_features_bite,  # noqa: E402
                              check_greedy_generate, check_logits_match)
from hf_parity_checks import hf_generate as _hf_generate  # noqa: E402
from hf_parity_checks import logits as _logits  # noqa: E402
from hf_parity_checks import relative_error as _relative_error  # noqa: E402
from hf_parity_checks import weight_files as _weight_files  # noqa: E402
MIN_MARGIN = 1e-3  # redraw prompts whose greedy top-2 logits come closer than this
EXPERTS = 8
LAYERS = 3
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=EXPERTS,
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128,
              initializer_range=0.1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=0.707, mscale_all_dim=0.8)


@dataclass(frozen=True)
class Case:
    model: str  # transformers class names
    config: str
    fields: dict
    # Config changes that must each change the logits (proof that the feature is exercised).
    ablations: dict = field(default_factory=dict)
    mtp: bool = False  # add one MTP module to the checkpoint, in DeepSeek's layout


CASES = {
    # MLA with a low-rank query and YaRN (both attention-scale terms), adjacent-pair rope, a dense
    # first layer, then sigmoid routing within the best 2 of 4 groups with the correction bias,
    # renormalised and scaled, and a shared expert.
    "deepseek_v3": Case("DeepseekV3ForCausalLM", "DeepseekV3Config",
                        dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                             rope_parameters=YARN, num_nextn_predict_layers=1),
                        ablations={"grouped routing": dict(n_group=1, topk_group=1),
                                   "yarn attention scale": dict(rope_parameters={**YARN, "mscale_all_dim": 0.0}),
                                   "interleaved rope": dict(rope_interleave=False),
                                   "routed scale": dict(routed_scaling_factor=1.0)},
                        mtp=True),
    # V2-Lite's full-rank query, attention biases, softmax routing within the best of 2 groups by
    # its best expert, never renormalised. (With top-2 routing, the best 2 groups by their best
    # expert always hold the overall top 2: one group of two makes the grouping matter.)
    "deepseek_v2": Case("DeepseekV2ForCausalLM", "DeepseekV2Config",
                        dict(q_lora_rank=None, attention_bias=True, topk_method="group_limited_greedy", n_group=2,
                             topk_group=1, routed_scaling_factor=1.5,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                        ablations={"grouped routing": dict(topk_method="greedy"),
                                   "routed scale": dict(routed_scaling_factor=1.0)}),
}
# V3 with rope by halves (rope_interleave false), biases, and dense layers only.
HALVES = Case("DeepseekV3ForCausalLM", "DeepseekV3Config",
              dict(q_lora_rank=24, rope_interleave=False, attention_bias=True, first_k_dense_replace=LAYERS,
                   num_nextn_predict_layers=0, rope_parameters=dict(rope_type="default", rope_theta=500.0)),
              ablations={"rope by halves": dict(rope_interleave=True)})


def _hf_model(case: Case, **changes):
    config = getattr(transformers, case.config)(**{**COMMON, **case.fields, **changes})
    config._attn_implementation = "eager"
    return getattr(transformers, case.model)(config).eval()


def _perturb(model, seed: int = 1) -> None:
    """Norm weights, biases and correction biases start as constants in HF; move them so a mix-up
    shows. Biases move less than norms: o_proj's bias joins every token's residual alike, and a
    large one would steer every token to the same experts."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith("bias"):
                scale = 0.3 if "norm" in name else 0.1 if "correction" in name else 0.05
                p.add_(scale * torch.randn(p.shape, generator=generator))


def _mtp_model(model):
    """transformers' MTP module for `model`, randomly initialised and perturbed like the model."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(model, 1).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # MtpModel leaves the experts' stacked weights uninitialised: draw all anew
        for name, p in mtp.layers.named_parameters():
            if p.ndim >= 2:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=generator))
    _perturb(mtp.layers, seed=3)
    return mtp


def _released_mtp_tensors(mtp) -> dict:
    """The MTP module's tensors named as DeepSeek's released checkpoints name layer 61 of V3:
    model.layers.{num_hidden_layers}.*, experts one tensor per projection, with the copies of
    the embedding and the head."""
    prefix = f"model.layers.{LAYERS}."
    tensors = {}
    for name, value in mtp.state_dict().items():
        value = value.detach().clone().contiguous()
        if name == "embed_tokens.weight":
            tensors[prefix + "embed_tokens.weight"] = value
            continue
        if name == "shared_head.weight":
            tensors[prefix + "shared_head.head.weight"] = value
            continue
        name = name.removeprefix("layers.0.").replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name == "mlp.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for e in range(EXPERTS):
                tensors[prefix + f"mlp.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                tensors[prefix + f"mlp.experts.{e}.up_proj.weight"] = up[e].contiguous()
        elif name == "mlp.experts.down_proj":
            for e in range(EXPERTS):
                tensors[prefix + f"mlp.experts.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            tensors[prefix + name] = value
    return tensors


@dataclass
class Built:
    case: Case
    model: object  # the HF model, float32, with the weights exactly as saved
    mtp: object | None  # transformers' MtpModel holding the checkpoint's MTP weights
    hf_dir: Path
    plain_dir: Path  # the checkpoint as transformers saved it (no MTP weights)
    out_dir: Path
    work: Path
    tokens: np.ndarray
    prompt: np.ndarray
    hf_sequences: np.ndarray


def _build(name: str, case: Case, work: Path) -> Built:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = _hf_model(case)
    _perturb(model)
    plain_dir = work / "plain"
    model.save_pretrained(plain_dir)
    hf_dir = work / "hf"
    shutil.copytree(plain_dir, hf_dir)
    mtp = None
    if case.mtp:
        mtp = _mtp_model(model)
        weights = hf_dir / "model.safetensors"
        save_file({**load_file(weights), **_released_mtp_tensors(mtp)}, weights, metadata={"format": "pt"})
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
    return Built(case, model, mtp, hf_dir, plain_dir, work / "out", work, tokens, prompt, sequences)


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory) -> Built:
    return _build(request.param, CASES[request.param], tmp_path_factory.mktemp(request.param))


def test_routers_pick_every_expert(built):
    """The reference's own routing sends the test tokens to every expert of every MoE layer, and
    not to one expert for most tokens: a wrong expert mapping cannot hide."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
             for layer in built.model.model.layers if hasattr(layer.mlp, "gate")]
    _logits(built.model, built.tokens)
    for hook in hooks:
        hook.remove()
    assert len(chosen) == LAYERS - 1
    for layer, experts in enumerate(chosen):
        load = np.bincount(experts.numpy().reshape(-1), minlength=EXPERTS)
        assert (load > 0).all() and load.max() < 0.5 * load.sum(), (layer, load)


def test_logits_match_transformers(built):
    check_logits_match(built)


def test_features_bite(built):
    check_features_bite(built, _hf_model)


@pytest.mark.parametrize("built", ["deepseek_v3"], indirect=True)
def test_correction_bias_bites(built):
    """The correction biases (buffers, not parameters, in transformers) steer the selection enough
    to move the logits: a checkpoint import that dropped them would show."""
    unbiased = _hf_model(built.case)
    unbiased.load_state_dict({name: torch.zeros_like(value) if name.endswith("e_score_correction_bias") else value
                              for name, value in built.model.state_dict().items()})
    assert _relative_error(_logits(unbiased, built.tokens), _logits(built.model, built.tokens)) > BITES


def test_greedy_generate_over_the_latent_cache_matches_transformers(built):
    check_greedy_generate(built)


def test_export_reproduces_checkpoint_bit_for_bit(built):
    back = built.work / "exported"
    assert main(["export-hf", str(built.out_dir), "-o", str(back)]) == 0
    assert _weight_files(back) == _weight_files(built.hf_dir)
    assert (back / "config.json").read_bytes() == (built.hf_dir / "config.json").read_bytes()


def test_export_without_record_loads_in_transformers(built, tmp_path):
    """A fresh config.json written from the spec alone is read by transformers as the same model
    (MTP layers, written in DeepSeek's layout, are left aside by DeepseekV3ForCausalLM), and
    imports back to the same spec."""
    from mxc.spec.load import load_model

    spec_only = tmp_path / "model"
    spec_only.mkdir()
    (spec_only / "model.mspec").write_text((built.out_dir / "model.mspec").read_text())
    exported = tmp_path / "hf"
    assert main(["export-hf", str(spec_only / "model.mspec"), "--params", str(built.out_dir / "params"),
                 "-o", str(exported)]) == 0
    reloaded = getattr(transformers, built.case.model).from_pretrained(exported, attn_implementation="eager",
                                                                      dtype=torch.float32).eval()
    assert _relative_error(_logits(reloaded, built.tokens), _logits(built.model, built.tokens)) < TOLERANCE
    assert main(["import-hf", str(exported), "-o", str(tmp_path / "again"), "--name", "again"]) == 0
    again = load_model(str(tmp_path / "again" / "model.mspec"))
    original = load_model(str(built.out_dir / "model.mspec"))
    assert again == original.model_copy(update={"name": "again"})


@pytest.mark.parametrize("built", ["deepseek_v3"], indirect=True)
def test_mtp_module_matches_transformers(built):
    """The imported MTP module, fed the main model's output, gives the logits transformers'
    MtpModel gives for the next-but-one tokens; forward and generate never run it."""
    import jax

    from mxc.compiler.hf.model_dir import load_spec_and_params
    from mxc.compiler.lower.model import decoder_hidden, output_head
    from mxc.compiler.lower.mtp import mtp_hidden

    spec, params = load_spec_and_params(str(built.out_dir))
    assert spec.mtp is not None and spec.mtp.depth == 1 and spec.mtp.block == "moe"

    @jax.jit
    def module_logits(params, tokens):
        hidden, _, _ = decoder_hidden(spec, params, tokens, dtype="float32")
        return output_head(spec, params, mtp_hidden(spec, params, hidden, tokens)[0][0])

    mine = np.asarray(module_logits(params, built.tokens))[:, :-1]
    tokens = torch.tensor(built.tokens)
    with torch.no_grad():
        main_output = built.model.model(tokens).last_hidden_state  # after the final norm
        positions = torch.arange(1, SEQ)[None].expand(2, -1)
        h = built.mtp.forward_layer(0, main_output[:, :-1], positions, None, input_ids=tokens[:, 1:])
        reference = built.mtp._project_to_logits(h).float().numpy()
    assert _relative_error(mine, reference) < TOLERANCE


@pytest.mark.parametrize("built", ["deepseek_v3"], indirect=True)
def test_checkpoint_saved_by_transformers_imports_without_mtp(built, tmp_path):
    """transformers saves no MTP weights yet keeps num_nextn_predict_layers: the import has no MTP
    modules, and the export gives back exactly the files transformers wrote."""
    from mxc.spec.load import load_model

    assert json.loads((built.plain_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert main(["import-hf", str(built.plain_dir), "-o", str(tmp_path / "out"), "--name", "plain"]) == 0
    spec = load_model(str(tmp_path / "out" / "model.mspec"))
    assert spec.mtp is None
    with_mtp = load_model(str(built.out_dir / "model.mspec"))
    assert spec == with_mtp.model_copy(update={"name": "plain", "mtp": None})
    assert main(["export-hf", str(tmp_path / "out"), "-o", str(tmp_path / "back")]) == 0
    assert _weight_files(tmp_path / "back") == _weight_files(built.plain_dir)
    assert (tmp_path / "back" / "config.json").read_bytes() == (built.plain_dir / "config.json").read_bytes()


@pytest.mark.parametrize("built", ["deepseek_v3"], indirect=True)
def test_mtp_copies_of_embedding_and_head_must_be_copies(built, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(built.hf_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors[f"model.layers.{LAYERS}.shared_head.head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert main(["import-hf", str(broken), "-o", str(tmp_path / "out")]) == 1


@pytest.mark.slow
def test_v3_with_rope_by_halves_matches_transformers(tmp_path):
    built = _build("deepseek_v3_halves", HALVES, tmp_path)
    test_features_bite(built)
    test_logits_match_transformers(built)
    test_greedy_generate_over_the_latent_cache_matches_transformers(built)
    test_export_reproduces_checkpoint_bit_for_bit(built)


REFERENCE = Path(__file__).resolve().parent / "data" / "param_counts.json"
CONFIG_CLASSES = {"DeepseekV2ForCausalLM": "DeepseekV2Config", "DeepseekV3ForCausalLM": "DeepseekV3Config"}


def _reference_deepseek_models() -> list[dict]:
    return [e for e in json.loads(REFERENCE.read_text()) if e["hf_class"] in CONFIG_CLASSES]


def test_real_configs_import_with_the_reference_parameter_counts():
    """config.json of DeepSeek-V2-Lite, V2, V3 and R1 (V3's architecture) imports to a spec with the
    parameter count transformers counts (V3's MTP module counted apart, as the reference does)."""
    from mxc.compiler.analysis import summarize
    from mxc.compiler.hf.config_in import spec_from_config

    entries = _reference_deepseek_models()
    assert len(entries) == 4
    for entry in entries:
        config = getattr(transformers, CONFIG_CLASSES[entry["hf_class"]])(**entry["config"]).to_dict()
        summary = summarize(spec_from_config(config, "m"))
        assert summary.total_params == entry["total_params"], entry["name"]
        if entry["hf_class"] == "DeepseekV3ForCausalLM":
            assert summary.mtp_params > 0


def test_zoo_models_export_the_reference_configs():
    """config.json written for each DeepSeek zoo model states the sizes the reference configs state."""
    from mxc.compiler.hf.config_out import config_from_spec
    from mxc.spec.load import load_model

    entries = [e for e in _reference_deepseek_models() if e["zoo"]]
    assert len(entries) == 4  # deepseek2-16b, deepseek2-236b, deepseek3-671b, deepseek-r1
    for entry in entries:
        config = config_from_spec(load_model(entry["zoo"]))
        assert config["architectures"] == [entry["hf_class"]], entry["zoo"]
        for key, value in entry["config"].items():
            if key != "moe_layer_freq":  # transformers' DeepSeek V2 does not read it (every layer past the dense ones is MoE)
                assert config.get(key) == value, (entry["zoo"], key)
