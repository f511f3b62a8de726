"""The calibrated step-time model on published MaxText results it was not fitted on
(tests/data/published_mfu_heldout.json): each row's MaxText setting compiled through `--maxtext`
(bench/plan_recipes.py --rows ..., terms in tests/data/calibration_terms_heldout.json), its MFU
estimated at the stated constants (FITTED) and set against the published MFU. Nothing is fitted
here. Fast: no compile, the estimates come from the saved terms (docs/plans.md, "Published
results outside the fit")."""

import functools
import math
import re

import pytest

from mxc.compiler.plan.calibration import DATA, FITTED, calibration_rows, published_rows

ROWS = DATA / "published_mfu_heldout.json"
TERMS = DATA / "calibration_terms_heldout.json"
# Each compiled row's relative error of the estimated MFU at FITTED, as docs/plans.md shows them.
ERRORS = {
    "MaxText 64B, v5p-128": -0.124,
    "MaxText 32B, v5p-128": -0.1,
    "MaxText 128B, v5p-256": -0.12,
    "MaxText 32B, 2 x v5p-128": -0.063,
    "Llama 2 70B, v6e-256": 0.054,
    "MaxText 16B, v5e-256": -0.061,
    "MaxText 32B, v5e-256": -0.163,
    "MaxText 128B, v5p-512": -0.128,
    "MaxText 128B, 2 x v5p-256": -0.044,
    "MaxText 16B, 2 x v5e-256": -0.061,
    "MaxText 32B, 2 x v5e-256": -0.159,
    "Llama 3.1 8B, v6e-8": 0.002,
    "Llama 3.1 8B, v6e-16": -0.01,
    "Llama 3.1 8B, v6e-32": 0.022,
    "Llama 3.1 8B, v6e-64": 0.016,
    "Llama 3.1 8B, v6e-128": 0.025,
    "Mistral 7B, v6e-8": -0.023,
    "Gemma 3 12B, v6e-256": 0.103,
    "Llama 3.1 70B, v6e-64": 0.145,
    "Llama 3.1 70B, v6e-128": 0.137,
    "Gemma 3 12B, 2 x v6e-256": -0.001,
    "Gemma 3 12B, 4 x v6e-256": 0.075,
    "Llama 3.1 405B, v5p-1024": -0.115,
    # Fits on v6e (29.2 GiB) since the embedding's gradient is formed in pieces of the vocabulary
    # (compiler/lower/embedding.py): XLA refused it at 33.50 GiB of temporaries before, and its
    # program compiled for 2 x v5p-512 stood in, at -16.8%.
    "Llama 3.1 405B, 2 x v6e-256 (pure FSDP)": 0.067,
    "Llama 4 Scout, v5p-1024": 0.061,
    # Compiled with the spec's param_dtype set to the recipe's weight_dtype (bfloat16), as a
    # MaxText user adds `--set param_dtype=bfloat16` (bench/plan_recipes.py).
    "Llama 3.1 70B, v6e-32": 0.094,
    "Mixtral 8x22B, v6e-256": -0.086,
    # Both fit since the dropless path runs megablox on fsdp x tensor meshes and gathers the expert
    # weights inside its region, and MLA's low-rank axes split like embed (docs/plans.md).
    "Llama 4 Maverick, v5p-256": -0.101,
    # As MaxText ran it: no multi-token prediction (mtp_num_layers 0, MaxText's default), so
    # compiled with `--set mtp=none` (bench/plan_recipes.py). Inside since megablox's kernels pay
    # for their tiles (hlo_cost.grouped_matmul_cost): +22.1% before.
    "DeepSeek V3 671B, v5p-1024": 0.136,
}
# What the issue asks of every row.
TARGET = 0.15
# Rows outside the target, with their error (docs/plans.md, "Published results outside the fit").
# Published MFUs on the estimates' FLOP count (calibration.published_mfu).
OUTSIDE = {
    # MaxText's December 2023 scaling rows, compiled as MaxText's parallel block: the 32B v5e rows
    # (fsdp 256, full remat) read slower than published, their recomputed matmuls alone at FITTED
    # about as long as the published step.
    "MaxText 32B, v5e-256": -0.163,
    "MaxText 32B, 2 x v5e-256": -0.159,
}
# Rows whose MaxText setting XLA (or mxc's --maxtext) does not compile here, and why: none since
# 28 November (Llama 4 Maverick was refused at 96.69 GiB, DeepSeek V3 at 179.72).
NOT_COMPILED: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _rows():
    rows, skipped = calibration_rows(TERMS, ROWS)
    return {row.name: row for row in rows}, dict(skipped)


def test_every_heldout_row_is_compiled_or_named_with_its_reason():
    rows, skipped = _rows()
    assert set(skipped) == set(NOT_COMPILED)
    assert set(rows) | set(skipped) == {row["name"] for row in published_rows(ROWS)}


def test_a_recipes_weight_dtype_needs_the_specs_param_dtype():
    # `--maxtext weight_dtype=bfloat16` alone is refused for a float32 spec, with what to add; the
    # bench compiles such rows with the spec's param_dtype set, as that message says.
    from mxc.compiler.plan.maxtext import MaxTextError, plan_setting
    from mxc.compiler.topology import parse

    rows = [row for row in published_rows(ROWS) if row["tuning_params"].get("weight_dtype") == "bfloat16"]
    assert {row["name"] for row in rows} >= {"Llama 3.1 70B, v6e-32", "Mixtral 8x22B, v6e-256"}
    for row in rows:
        spec = _load(row["model"])
        if spec.param_dtype == "bfloat16":
            continue
        with pytest.raises(MaxTextError, match=r"add --set param_dtype=bfloat16"):
            plan_setting(spec, parse(row["topology"], row["slices"]), row["tuning_params"],
                         seq=row["seq"], verify=False)


def _log_figures(row: dict) -> tuple[float | None, float]:
    """(step seconds or None, tokens/s/device) of a recipe's log line as the row prints it."""
    step = re.search(r"step ([0-9.]+) s", row["published_as_printed"])
    tokens = re.search(r"([0-9.]+) tokens/s/device", row["published_as_printed"])
    return (float(step.group(1)) if step else None), float(tokens.group(1))


def test_recipe_rows_mfu_is_the_logs_tokens_on_mxcs_count():
    # tpu-recipes rows: published_mfu = the log's tokens/s/device x mxc's training FLOPs per
    # token / the chip's peak, and the log's step time is the row's batch per chip over them.
    from mxc.compiler.analysis import summarize
    from mxc.compiler.topology import parse

    recipes = [row for row in published_rows(ROWS) if "tpu-recipes" in row["maxtext_config"]]
    assert recipes
    for row in recipes:
        step, tokens = _log_figures(row)
        topology = parse(row["topology"], row["slices"])
        per_token = summarize(_load(row["model"]), row["seq"]).train_flops_per_token
        assert row["published_mfu"] == pytest.approx(tokens * per_token / topology.chip.peak_bf16_flops, abs=5e-5)
        assert row["published_tokens_per_s_per_device"] == round(tokens)
        if step is not None:
            chips = topology.chips_per_slice * row["slices"]
            assert step * tokens == pytest.approx(row["global_batch"] / chips * row["seq"], rel=2e-4), row["name"]


def _load(ref: str):
    from mxc.spec.load import load_model

    path, _, name = ref.rpartition(":")
    return load_model(f"{DATA.parent.parent / path}:{name}" if path.endswith(".mspec") else ref)


def test_each_rows_error_at_the_fitted_constants():
    # Moving a constant in calibration.py, or a row's terms, fails here.
    rows, _ = _rows()
    errors = {name: round(row.estimate(FITTED) / row.published_mfu - 1, 3) for name, row in rows.items()}
    assert errors == ERRORS


def test_within_the_target_or_a_named_exception():
    rows, _ = _rows()
    for name, row in rows.items():
        error = row.estimate(FITTED) / row.published_mfu - 1
        assert abs(error) <= abs(OUTSIDE.get(name, TARGET)) + 5e-4, (name, error)


def _maxtext_scales(scale: int) -> tuple[int, int, int, int]:
    """MaxText's global_parameter_scale rule (MaxText/pyconfig.py at 76bd53b0f,
    get_individual_scales): doublings of (embed, heads, mlp, layers)."""
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


@pytest.mark.parametrize("scale", [16, 32, 64, 128])
def test_the_synthetic_models_follow_maxtexts_scale_rule(scale):
    from mxc.compiler.analysis import summarize
    from mxc.spec.load import load_model

    spec = load_model(f"{DATA / 'maxtext_synthetic.mspec'}:maxtext-{scale}b")
    emb, heads, mlp, layers = _maxtext_scales(scale)
    (block,) = spec.blocks.values()
    # base.yml of that commit: base_emb_dim 2560, base_num_heads 8, base_mlp_dim 8192,
    # base_num_decoder_layers 16.
    assert (spec.d_model, block.attention.heads, block.mlp.hidden) == (2560 << emb, 8 << heads, 8192 << mlp)
    assert summarize(spec).num_layers == 16 << layers
    assert abs(summarize(spec).total_params / (scale * 1e9) - 1) < 0.02
