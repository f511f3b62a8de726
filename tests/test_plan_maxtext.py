"""`mxc plan --maxtext KEY=VALUE`: MaxText's settings read as MaxText writes them, each key used,
ignored (and said so) or refused; the JSON is an automatic plan's, with the time fields."""

import json
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest

from mxc.compiler.cli import main
from mxc.compiler.plan.maxtext import MaxTextError, parse_pairs, plan_setting, setting
from mxc.compiler.topology import parse
from mxc.spec.load import load_model, load_models

LLAMA_8B_RECIPE = ["per_device_batch_size=4", "ici_fsdp_parallelism=-1", "remat_policy=custom",
                   "decoder_layer_input=offload", "out_proj=offload", "query_proj=offload", "key_proj=offload",
                   "value_proj=offload", "max_target_length=8192", "attention=flash"]


def _setting(model, topology, pairs, slices=1, **shapes):
    return setting(parse_pairs(pairs), load_model(model), parse(topology, slices), **shapes)


def test_values_are_read_as_maxtext_writes_them():
    assert parse_pairs(["a=4", "b=-1", "c=1.25", "d=false", "e=True", "f=offload"]) == {
        "a": 4, "b": -1, "c": 1.25, "d": False, "e": True, "f": "offload"}
    with pytest.raises(MaxTextError, match="KEY=VALUE"):
        parse_pairs(["per_device_batch_size"])
    with pytest.raises(MaxTextError, match="given twice"):
        parse_pairs(["a=1", "a=2"])


def test_a_published_recipe_becomes_its_mesh_batch_and_policy():
    s = _setting("llama3.1-8b", "v6e-256", LLAMA_8B_RECIPE)
    assert s.mesh == {"stage": 1, "data": 1, "fsdp": 256, "context": 1, "expert": 1, "tensor": 1} and s.dcn == {}
    assert (s.seq, s.batch, s.microbatches) == (8192, 1024, 1)
    assert s.remat == ("custom:decoder_layer_input=offload,query_proj=offload,key_proj=offload,"
                       "value_proj=offload,out_proj=offload")
    assert s.attention == "splash"


def test_minus_one_takes_the_devices_left_over_in_ici_and_dcn():
    s = _setting("llama3.1-405b", "v6e-256", ["per_device_batch_size=1", "ici_fsdp_parallelism=64",
                                             "ici_tensor_parallelism=4", "dcn_fsdp_parallelism=2",
                                             "max_target_length=8192"], slices=2)
    assert s.mesh["fsdp"] == 128 and s.mesh["tensor"] == 4 and s.dcn == {"fsdp": 2}
    assert s.batch == 512
    # MaxText's defaults: fsdp takes the slice's devices left over, data the slices left over.
    s = _setting("llama3.1-8b", "v6e-256", ["per_device_batch_size=2", "ici_tensor_parallelism=4"],
                 slices=2, seq=4096)
    assert s.mesh["fsdp"] == 64 and s.mesh["tensor"] == 4 and s.mesh["data"] == 2 and s.dcn == {"data": 2}
    s = _setting("llama3.1-8b", "v6e-256", ["per_device_batch_size=2", "ici_tensor_parallelism=-1",
                                           "ici_fsdp_parallelism=32"], seq=4096)
    assert s.mesh["tensor"] == 8 and any("ici_tensor_parallelism -1" in n for n in s.notes)
    with pytest.raises(MaxTextError, match="only one ici axis may be -1"):
        _setting("llama3.1-8b", "v6e-256", ["ici_tensor_parallelism=-1", "ici_fsdp_parallelism=-1",
                                           "per_device_batch_size=1"], seq=4096)
    with pytest.raises(MaxTextError, match="multiply to 512"):
        _setting("llama3.1-8b", "v6e-256", ["ici_tensor_parallelism=2", "ici_fsdp_parallelism=256",
                                           "per_device_batch_size=1"], seq=4096)


def test_axes_without_a_twin_map_to_the_nearest_and_say_so():
    s = _setting("llama3.1-8b", "v6e-256", ["per_device_batch_size=1", "ici_fsdp_transpose_parallelism=4",
                                           "ici_fsdp_parallelism=-1", "ici_sequence_parallelism=2"], seq=8192)
    assert s.mesh["fsdp"] == 128 and s.mesh["context"] == 2
    assert any("fsdp_transpose" in n and "nearest" in n for n in s.notes)
    assert any("sequence" in n and "context" in n for n in s.notes)
    with pytest.raises(MaxTextError, match="pipeline stages"):
        _setting("llama3.1-8b", "v6e-256", ["per_device_batch_size=1", "ici_pipeline_parallelism=2"], seq=4096)
    with pytest.raises(MaxTextError, match="inference-only"):
        _setting("llama3.1-8b", "v6e-256", ["per_device_batch_size=1", "ici_autoregressive_parallelism=2"],
                 seq=4096)


def test_remat_policies_by_maxtext_name():
    for name in ("full", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
                 "qkv_proj_offloaded", "minimal_offloaded"):
        assert _setting("llama2-70b", "v5p-512", [f"remat_policy={name}", "per_device_batch_size=4"],
                        seq=4096).remat == name
    assert _setting("llama2-70b", "v5p-512", ["per_device_batch_size=4"], seq=4096).remat == "full"
    custom = _setting("llama2-70b", "v5p-512", ["remat_policy=custom", "mlpwi_0=device", "mlpwi_1=device",
                                                "mlpwo=offload", "context=remat", "per_device_batch_size=4"], seq=4096)
    assert custom.remat == "custom:mlpwi=device,mlpwo=offload"
    with pytest.raises(MaxTextError, match="need remat_policy=custom"):
        _setting("llama2-70b", "v5p-512", ["query_proj=offload", "per_device_batch_size=4"], seq=4096)
    with pytest.raises(MaxTextError, match="unknown remat policy"):
        _setting("llama2-70b", "v5p-512", ["remat_policy=save_everything", "per_device_batch_size=4"], seq=4096)
    with pytest.raises(MaxTextError, match="device, offload or remat"):
        _setting("llama2-70b", "v5p-512", ["remat_policy=custom", "query_proj=host", "per_device_batch_size=4"],
                 seq=4096)


def test_batch_sequence_and_accumulation():
    s = _setting("llama2-70b", "v5p-512", ["per_device_batch_size=2", "gradient_accumulation_steps=4",
                                           "max_target_length=4096"])
    assert (s.batch, s.microbatches, s.seq) == (2 * 256 * 4, 4, 4096)
    assert _setting("llama2-70b", "v5p-512", ["per_device_batch_size=2"], seq=4096, batch=64).batch == 64
    with pytest.raises(MaxTextError, match="disagree"):
        _setting("llama2-70b", "v5p-512", ["per_device_batch_size=2", "max_target_length=4096"], seq=2048)
    with pytest.raises(MaxTextError, match="per_device_batch_size=N is needed"):
        _setting("llama2-70b", "v5p-512", ["max_target_length=4096"])


def test_experts_follow_capacity_factor_sparse_matmul_and_megablox():
    dropped = ["per_device_batch_size=12", "capacity_factor=1.25", "megablox=false", "sparse_matmul=false"]
    assert _setting("mixtral-8x7b", "v6e-256", dropped, seq=4096).experts == ("capacity", 1.25)
    dropless = ["per_device_batch_size=12", "capacity_factor=-1", "sparse_matmul=true", "megablox=true"]
    assert _setting("mixtral-8x7b", "v6e-256", dropless, seq=4096).experts == ("dropless", None)
    with pytest.raises(MaxTextError, match="megablox=false"):
        _setting("mixtral-8x7b", "v6e-256", ["per_device_batch_size=1", "sparse_matmul=true", "megablox=false"],
                 seq=4096)
    dense = _setting("llama2-70b", "v5p-512", ["per_device_batch_size=4", *dropped[1:]], seq=4096)
    assert dense.experts is None and {"capacity_factor", "megablox", "sparse_matmul"} <= set(dense.ignored)


def test_keys_that_do_not_change_the_program_are_listed_as_ignored():
    s = _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "sa_block_q=1024", "dataset_type=synthetic",
                                           "steps=20", "scan_layers=true", "dtype=bfloat16"])
    assert {"sa_block_q", "dataset_type", "steps", "scan_layers"} <= set(s.ignored)


def test_the_weight_and_activation_dtypes_are_the_specs():
    # MaxText's weight_dtype and dtype are the spec's param_dtype and compute_dtype: a value the
    # spec does not have says how to set it (tpu-recipes' Llama 3.1 70B on v6e-32 keeps bfloat16 weights).
    s = _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "weight_dtype=float32", "dtype=bfloat16"])
    assert "weight_dtype float32: the spec's param_dtype" in s.notes
    with pytest.raises(MaxTextError, match="param_dtype is float32; add --set param_dtype=bfloat16"):
        _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "weight_dtype=bfloat16"])
    spec = load_model("llama3.1-8b").model_copy(update={"param_dtype": "bfloat16"})
    params = parse_pairs([*LLAMA_8B_RECIPE, "weight_dtype=bfloat16"])
    assert "weight_dtype bfloat16: the spec's param_dtype" in setting(params, spec, parse("v6e-256")).notes


def test_multi_token_prediction_is_the_specs():
    # MaxText's mtp_num_layers defaults to 0: a recipe without it is DeepSeek V3 without its MTP
    # module, which mxc compiles only when told (tpu-recipes' DeepSeek3-671B ran so).
    deepseek = ["per_device_batch_size=1", "ici_fsdp_parallelism=-1", "remat_policy=full", "sparse_matmul=true",
                "max_target_length=4096"]
    with pytest.raises(MaxTextError, match="deepseek3-671b has 1 multi-token prediction module.*add --set mtp=none"):
        _setting("deepseek3-671b", "v5p-1024", deepseek)
    s = _setting("deepseek3-671b", "v5p-1024", [*deepseek, "mtp_num_layers=1", "mtp_loss_scaling_factor=0.3"])
    assert "mtp_num_layers 1: the spec's multi-token prediction" in s.notes
    with pytest.raises(MaxTextError, match="loss weight is 0.3; add --set mtp.loss_weight=0.1"):
        _setting("deepseek3-671b", "v5p-1024", [*deepseek, "mtp_num_layers=1", "mtp_loss_scaling_factor=0.1"])
    without = next(iter(load_models("deepseek3-671b", ["mtp=none"]).values()))
    s = setting(parse_pairs([*deepseek, "mtp_loss_scaling_factor=0.1"]), without, parse("v5p-1024"))
    assert "mtp_loss_scaling_factor" in s.ignored
    with pytest.raises(MaxTextError, match="llama3.1-8b has 0 multi-token prediction"):
        _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "mtp_num_layers=1"])
    with pytest.raises(MaxTextError, match="mtp_num_layers=-1: a whole number"):
        _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "mtp_num_layers=-1"])


def test_a_key_that_would_change_the_program_is_refused():
    with pytest.raises(MaxTextError, match="not a MaxText setting mxc knows"):
        _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "mu_dtype=bfloat16"])
    with pytest.raises(MaxTextError, match="scan_layers=True only"):
        _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "scan_layers=false"])
    with pytest.raises(MaxTextError, match="compute_dtype is bfloat16; add --set compute_dtype=float32"):
        _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "dtype=float32"])


def test_vocab_tiling_and_optimizer_offload_map_to_the_loss_in_pieces_and_the_state_on_host(capsys):
    # MaxText's num_vocab_tiling is mxc's loss over pieces of the sequence; its
    # optimizer_memory_host_offload keeps AdamW's moments in host memory. Both reach the plan's
    # lowering (what `mxc compile --plan` builds), its memory prediction and its text.
    s = _setting("llama3.1-8b", "v6e-256", [*LLAMA_8B_RECIPE, "num_vocab_tiling=16",
                                           "optimizer_memory_host_offload=true"])
    assert s.loss_chunks == 16 and s.optimizer_state_on_host
    plain = _setting("llama3.1-8b", "v6e-256", LLAMA_8B_RECIPE)
    assert plain.loss_chunks == 1 and not plain.optimizer_state_on_host
    args = ["plan", "llama3.1-8b", "--topology", "v6e-256", "--no-verify"]
    recipe = [a for pair in LLAMA_8B_RECIPE for a in ("--maxtext", pair)]
    main([*args, "--json", *recipe])
    before = json.loads(capsys.readouterr().out)
    main([*args, "--json", *recipe, "--maxtext", "num_vocab_tiling=16", "--maxtext", "optimizer_memory_host_offload=true"])
    after = json.loads(capsys.readouterr().out)
    assert before["lowering"]["loss_chunks"] == 1 and "optimizer_state_on_host" not in before["lowering"]
    assert after["lowering"]["loss_chunks"] == 16 and after["lowering"]["optimizer_state_on_host"] is True
    # The moments go to host memory (twice: the updated layers' are written to a second buffer),
    # HBM holding a share of them during the update (memory.py's MOMENTS_IN_HBM_WHEN_ON_HOST);
    # the norms' pieces (16 floats a device) stay in HBM (optimizer.host_tiles_accept).
    moments = before["predicted"]["optimizer_state"]
    assert 0 < after["predicted"]["optimizer_state"] < moments / 4
    assert 0.9999 * 2 * moments < after["predicted"]["host"] - before["predicted"]["host"] < 2 * moments
    assert after["time"]["communication"]["optimizer state over the host link"] > 0
    assert after["time"]["step_s"] > before["time"]["step_s"]
    main([*args, "--explain", *recipe, "--maxtext", "num_vocab_tiling=16", "--maxtext", "optimizer_memory_host_offload=true"])
    text = capsys.readouterr().out
    assert "loss          in 16 pieces" in text and "optimizer     AdamW's moments in host memory" in text
    assert "num_vocab_tiling 16" in text and "optimizer_memory_host_offload true" in text


def test_command_prints_the_same_json_as_an_automatic_plan_with_time_fields(capsys):
    args = ["plan", "llama3.1-8b", "--topology", "v6e-256", "--no-verify", "--json"]
    main([*args, *(a for pair in LLAMA_8B_RECIPE for a in ("--maxtext", pair))])
    fixed = json.loads(capsys.readouterr().out)
    main([*args, "--seq", "8192", "--batch", "1024", "--pin", "fsdp=256", "--remat", "full", "--microbatches", "4"])
    automatic = json.loads(capsys.readouterr().out)
    assert set(fixed) == set(automatic)
    for plan in (fixed, automatic):
        assert plan["mesh"]["stage"] == 1
        assert {"mfu", "tokens_per_s_per_device", "bubble_fraction"} <= set(plan["time"])
        assert plan["time"]["bubble_fraction"] == 0.0
    assert fixed["remat"].startswith("custom:decoder_layer_input=offload")
    assert fixed["batch"] == 1024 and fixed["seq"] == 8192 and fixed["mesh"]["fsdp"] == 256
    assert any("ignored" not in r and "per_device_batch_size 4" in r for r in fixed["reasons"])


def test_command_errors_are_one_line(capsys):
    base = ["plan", "llama3.1-8b", "--topology", "v6e-256", "--no-verify"]
    assert main([*base, "--maxtext", "per_device_batch_size=4", "--maxtext", "max_target_length=8192",
                 "--maxtext", "mu_dtype=bfloat16"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("mxc: error: --maxtext mu_dtype") and "Traceback" not in err
    assert main([*base, "--maxtext", "per_device_batch_size=4", "--maxtext", "max_target_length=8192",
                 "--maxtext", "num_vocab_tiling=3"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("mxc: error: --maxtext num_vocab_tiling=3") and "Traceback" not in err
    assert main([*base, "--maxtext", "per_device_batch_size=4", "--pin", "tensor=4", "--seq", "8192"]) != 0
    assert "cannot be combined" in capsys.readouterr().err


def test_tensor_parallelism_splits_the_activations_between_layers_as_maxtext_does():
    # MaxText's activation_embed rule splits each layer's input over tensor; mxc's twin is the
    # residual stream's sequence split over tensor (without it, Llama 3.1 405B's offloaded layer
    # inputs needed 287 GiB of host memory of 128 on 2 x v6e-256).
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_plan import SMALL_LLAMA
    from mxc.spec.load import load_text

    spec = load_text(SMALL_LLAMA, "small.mspec")["llama-small"]
    common = ["per_device_batch_size=2", "remat_policy=custom", "decoder_layer_input=offload",
              "max_target_length=1024"]
    split = plan_setting(spec, parse("v5e-8"), parse_pairs([*common, "ici_tensor_parallelism=2"]), verify=False)
    whole = plan_setting(spec, parse("v5e-8"), parse_pairs(common), verify=False)
    assert split.rules["residual_seq"] == ["context", "tensor"] and whole.rules["residual_seq"] == ["context"]
    assert any("activation_embed" in r for r in split.reasons)
    # Per device, as much offloaded as with fsdp alone: twice the sequences per fsdp shard, each
    # split in two.
    assert split.predicted.host == whole.predicted.host


@pytest.mark.slow
def test_the_setting_is_compiled_and_estimated_from_the_program():
    # A two-layer Llama on a v5e-8 (libtpu's description), MaxText's way: fsdp 4 x tensor 2.
    # About a minute of CPU (the train step compiled for a TPU slice).
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_plan import SMALL_LLAMA
    from mxc.spec.load import load_text

    spec = load_text(SMALL_LLAMA, "small.mspec")["llama-small"]
    params = parse_pairs(["per_device_batch_size=2", "ici_tensor_parallelism=2", "remat_policy=minimal",
                          "max_target_length=1024"])
    terms = []
    plan = plan_setting(spec, parse("v5e-8"), params, terms=terms)
    assert plan.xla.status == "fits", plan.xla.reason
    assert plan.mesh["fsdp"] == 4 and plan.mesh["tensor"] == 2 and plan.batch == 16
    assert plan.time.source == "compiled program" and len(terms) == 1
    assert 0 < plan.time.mfu < 1
    # Tensor parallelism's all-reduces are in the program, synchronous.
    assert terms[0].by_kind.get("all-reduce", 0) > 0 and terms[0].exposed_collectives_s > 0


def test_a_device_order_key_is_compiled_with_mxcs_order_and_said():
    # MaxText's custom_mesh (Mixtral 8x22B's hybrid_ring_64x4) orders the devices only: the same
    # program on each, so mxc compiles it with its own order and says so in the setting's notes.
    chosen = setting({"per_device_batch_size": 1, "ici_fsdp_parallelism": -1, "custom_mesh": "hybrid_ring_64x4"},
                     load_model("llama3-tiny"), parse("v5p-8"), seq=128)
    assert any(n.startswith("custom_mesh hybrid_ring_64x4: MaxText's device order") for n in chosen.notes)
