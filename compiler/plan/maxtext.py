"""MaxText's settings, as MaxText writes them (`--maxtext KEY=VALUE`), turned into one fixed mxc
setting: mesh, remat policy, batch, microbatches, MoE path, attention.

Every key is either used (and said how), accepted as not changing the compiled program (data,
logging, checkpointing, kernel block sizes), or refused with a clear error: a key that would
change the program and that mxc cannot honour is never dropped in silence.

MaxText's defaults apply to what is not given (MaxText/configs/base.yml): `ici_fsdp_parallelism`
takes the devices left over in a slice when no other ICI axis does (-1), `dcn_data_parallelism`
the slices left over; the custom remat policy rematerialises every name not set, and keeps the
layer's input on device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# MaxText's mesh axes (ici_NAME_parallelism / dcn_NAME_parallelism) -> mxc's axis, and why where
# mxc has no twin.
MESH_AXIS_MAP = {
    "data": ("data", ""),
    "fsdp": ("fsdp", ""),
    "fsdp_transpose": ("fsdp", "mxc has no fsdp_transpose axis; its weights are split over fsdp, the nearest"),
    "sequence": ("context", "MaxText's sequence axis splits the sequence, as mxc's context axis does"),
    "context": ("context", ""),
    "context_autoregressive": ("context", "an inference axis in MaxText; mxc's context axis is the nearest"),
    "tensor": ("tensor", ""),
    "tensor_transpose": ("tensor", "mxc has no tensor_transpose axis; the nearest is tensor"),
    "tensor_sequence": ("tensor", "mxc has no tensor_sequence axis; the nearest is tensor"),
    "expert": ("expert", ""),
    "autoregressive": (None, "an inference-only axis in MaxText"),
    "pipeline": ("stage", ""),
}
# Names MaxText's custom remat policy takes, -> the checkpoint name mxc's layer code tags.
REMAT_NAMES = {"decoder_layer_input": "decoder_layer_input", "query_proj": "query_proj",
               "key_proj": "key_proj", "value_proj": "value_proj", "out_proj": "out_proj",
               "context": "context", "mlpwi": "mlpwi", "mlpwi_0": "mlpwi", "mlpwi_1": "mlpwi",
               "mlpwo": "mlpwo"}
# Keys that do not change the compiled train step: data, logging, checkpointing, profiling,
# run-time hyperparameters, kernels' block sizes.
IGNORED = frozenset({
    "run_name", "base_output_directory", "steps", "log_period", "enable_checkpointing", "async_checkpointing",
    "checkpoint_period", "save_config_to_gcs", "metrics_file", "gcs_metrics", "enable_goodput_recording",
    "monitor_goodput", "goodput_upload_interval_seconds", "enable_pathways_goodput", "profiler",
    "skip_first_n_steps_for_profiler", "profiler_steps", "profile_cleanly", "upload_all_profiler_results",
    "dataset_type", "dataset_path", "dataset_name", "tokenizer_path", "tokenizer_type", "train_split",
    "reuse_example_batch", "enable_data_shuffling", "data_shuffle_seed", "eval_interval", "eval_steps",
    "learning_rate", "warmup_steps_fraction", "learning_rate_schedule_steps", "cosine_learning_rate_final_fraction",
    "adam_b1", "adam_b2", "adam_eps", "adam_weight_decay", "gradient_clipping_threshold",
    "allow_split_physical_axes", "use_iota_embed", "enable_single_controller", "skip_jax_distributed_system",
    "sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv",
    "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq", "sa_use_fused_bwd_kernel",
    "sa_q_layout", "sa_k_layout", "sa_v_layout", "tile_batch_seq", "tile_embed_dim", "tile_mlp_dim",
    "tile_activation_dim", "tile_weight_dim", "megablox_tile_sizes",
})
# Keys that only order the devices of the mesh (the same program on every device, its collectives
# over other device groups): mxc lays its mesh out along the torus itself (topology.device_mesh).
DEVICE_ORDER = {
    # MaxText's create_custom_64x4_device_mesh: on each 16 x 16 slice, every group of 4 along the
    # last mesh axis is a 2 x 2 block of chips taken as a ring.
    "custom_mesh": "MaxText's device order for its mesh; compiled with mxc's own order",
}
# Keys whose only accepted value is what mxc does anyway.
SAME_AS_MXC = {"scan_layers": True, "opt_type": "adamw", "quantization": "", "fused_qkv": None, "fused_mlp": None}
# Keys that must agree with a field of the spec (which --set changes): MaxText's weight and
# activation dtypes are mxc's parameter and compute dtypes.
SPEC_FIELDS = {"weight_dtype": "param_dtype", "dtype": "compute_dtype"}
MOE_KEYS = ("capacity_factor", "megablox", "sparse_matmul")
PIPELINE_KEYS = ("num_pipeline_microbatches", "num_layers_per_pipeline_stage", "pipeline_parallel_layers")
USED = ("per_device_batch_size", "remat_policy", "max_target_length", "gradient_accumulation_steps",
        "attention", "logits_dot_in_fp32", "num_vocab_tiling", "optimizer_memory_host_offload",
        *PIPELINE_KEYS, *MOE_KEYS)


class MaxTextError(ValueError):
    """A MaxText setting mxc cannot compile as written."""


@dataclass
class Setting:
    """One fixed mxc setting and how each MaxText key was read."""

    seq: int
    batch: int
    mesh: dict[str, int]  # mxc axis -> whole size
    dcn: dict[str, int]  # mxc axis -> the factor across slices
    remat: str
    microbatches: int = 1
    attention: str | None = None  # None: what mxc picks for the topology
    experts: tuple[str | None, float | None] | None = None  # (expert path, capacity factor)
    notes: list[str] = field(default_factory=list)  # how keys were used, in order
    ignored: list[str] = field(default_factory=list)  # keys that do not change the program
    float32_logits_dot: bool = False  # MaxText's logits_dot_in_fp32 (its default: the head in bf16)
    loss_chunks: int = 1  # MaxText's num_vocab_tiling: the loss over this many pieces
    optimizer_state_on_host: bool = False  # MaxText's optimizer_memory_host_offload


def parse_pairs(pairs: list[str]) -> dict[str, object]:
    """KEY=VALUE strings -> {key: value}, values read as MaxText's YAML would (ints, floats,
    true/false, else strings)."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise MaxTextError(f"--maxtext {pair}: write KEY=VALUE, e.g. --maxtext per_device_batch_size=4")
        if key in out:
            raise MaxTextError(f"--maxtext {key} is given twice")
        out[key] = _value(raw.strip())
    return out


def _value(raw: str):
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw.strip("'\"")


def setting(params: dict[str, object], spec, topology, *, seq: int | None = None, batch: int | None = None) -> Setting:
    """The mxc setting for MaxText's `params` on `topology`; `seq` and `batch` are the command
    line's (they win over max_target_length and per_device_batch_size, and must agree)."""
    from mxc.compiler.kinds import kind_of

    params = dict(params)
    notes: list[str] = []
    ignored = sorted(k for k in params if k in IGNORED)
    for key in ignored:
        params.pop(key)
    for key, value in list(params.items()):
        if key in SPEC_FIELDS:
            field_name = SPEC_FIELDS[key]
            if value != getattr(spec, field_name):
                raise MaxTextError(f"--maxtext {key}={value}: {spec.name}'s {field_name} is {getattr(spec, field_name)}; "
                                   f"add --set {field_name}={value} to compile it with {value}")
            notes.append(f"{key} {value}: the spec's {field_name}")
            params.pop(key)
        elif key in DEVICE_ORDER:
            notes.append(f"{key} {value}: {DEVICE_ORDER[key]}")
            params.pop(key)
        elif key in SAME_AS_MXC:
            expected = SAME_AS_MXC[key]
            if expected is not None and value != expected:
                raise MaxTextError(f"--maxtext {key}={value}: mxc compiles {key}={expected} only")
            ignored.append(key)
            params.pop(key)
    _multi_token_prediction(params, spec, notes, ignored)
    moe = any(kind_of(block.mlp).routing(block.mlp) is not None for block in spec.blocks.values())
    axes_keys = {k for k in params if k.startswith(("ici_", "dcn_")) and k.endswith("_parallelism")}
    remat_keys = {k for k in params if k in REMAT_NAMES}
    unknown = sorted(set(params) - axes_keys - remat_keys - set(USED))
    if unknown:
        raise MaxTextError(f"--maxtext {unknown[0]}: not a MaxText setting mxc knows; it compiles "
                           f"{', '.join(USED)}, ici_*/dcn_*_parallelism and the custom remat names "
                           f"({', '.join(REMAT_NAMES)}), and ignores data, logging and kernel block sizes")

    mesh, dcn = _mesh(params, axes_keys, topology, notes)
    seq = _seq(params, spec, seq, notes)
    steps = _positive_int(params, "gradient_accumulation_steps", 1)
    given = [k for k in PIPELINE_KEYS if k in params]
    if mesh["stage"] == 1 and given:
        ignored.extend(given)
        notes.append(f"{', '.join(given)}: no pipeline stages, so they do not change the program")
    per_device = params.get("per_device_batch_size")
    if batch is None:
        if per_device is None:
            raise MaxTextError("--maxtext per_device_batch_size=N is needed (or --batch)")
        if not isinstance(per_device, (int, float)) or per_device <= 0:
            raise MaxTextError(f"--maxtext per_device_batch_size={per_device}: a positive number")
        batch = per_device * topology.chips * steps
        if batch != int(batch):
            raise MaxTextError(f"per_device_batch_size {per_device} x {topology.chips} devices is not a whole batch")
        batch = int(batch)
        accumulation = f" x {steps} accumulation steps" if steps > 1 else ""
        notes.append(f"per_device_batch_size {per_device}: global batch {per_device} x {topology.chips} devices"
                     f"{accumulation} = {batch}")
    elif per_device is not None:
        notes.append(f"per_device_batch_size {per_device}: --batch {batch} given, it decides the batch")
    if batch % steps:
        raise MaxTextError(f"gradient_accumulation_steps {steps} does not divide the batch of {batch}")
    if steps > 1:
        notes.append(f"gradient_accumulation_steps {steps}: {steps} microbatches")
    remat = _remat(params, remat_keys, notes)
    microbatches = steps if mesh["stage"] == 1 else _pipeline(params, spec, mesh["stage"], steps, batch, remat, notes)
    attention = _attention(params, topology, seq, mesh, notes, ignored)
    experts = _experts(params, moe, topology, notes, ignored)
    float32_logits_dot = _logits_dot(params, notes)
    loss_chunks = _vocab_tiling(params, seq, mesh, notes)
    on_host = _optimizer_offload(params, notes)
    return Setting(seq, batch, mesh, dcn, remat, microbatches, attention, experts, notes, sorted(ignored),
                   float32_logits_dot, loss_chunks, on_host)


def _multi_token_prediction(params, spec, notes: list[str], ignored: list[str]) -> None:
    """MaxText's mtp_num_layers (default 0: no multi-token prediction) must be the spec's MTP depth:
    the modules are part of the program, so a spec that has them is compiled without them only
    when the user says so (`--set mtp=none`), as for the dtypes."""
    layers = params.pop("mtp_num_layers", 0)
    scaling = params.pop("mtp_loss_scaling_factor", None)
    depth = spec.mtp.depth if spec.mtp is not None else 0
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:
        raise MaxTextError(f"--maxtext mtp_num_layers={layers}: a whole number of layers, 0 or more")
    if layers != depth:
        if layers == 0:
            raise MaxTextError(f"--maxtext mtp_num_layers 0 (MaxText's default): {spec.name} has {depth} "
                               "multi-token prediction module(s); add --set mtp=none to compile it without them")
        raise MaxTextError(f"--maxtext mtp_num_layers={layers}: {spec.name} has {depth} multi-token prediction "
                           "module(s); mxc compiles the spec's")
    if depth == 0:
        if scaling is not None:
            ignored.append("mtp_loss_scaling_factor")  # no modules: it weighs nothing
        return
    notes.append(f"mtp_num_layers {layers}: the spec's multi-token prediction")
    if scaling is not None and float(scaling) != spec.mtp.loss_weight:
        raise MaxTextError(f"--maxtext mtp_loss_scaling_factor={scaling}: {spec.name}'s MTP loss weight is "
                           f"{spec.mtp.loss_weight}; add --set mtp.loss_weight={scaling} to compile it with {scaling}")


def _vocab_tiling(params, seq: int, mesh, notes: list[str]) -> int:
    """MaxText's num_vocab_tiling: the output head and loss over that many tiles of the tokens,
    each tile's logits recomputed in the backward pass; mxc's twin is the loss over pieces of the
    sequence (LoweringChoices.loss_chunks), which needs the device's piece of the sequence to
    split evenly (MaxText tiles batch x sequence)."""
    tiles = _positive_int(params, "num_vocab_tiling", 1)
    if tiles == 1:
        return 1
    local_seq = seq // mesh["context"]
    if local_seq % tiles:
        raise MaxTextError(f"--maxtext num_vocab_tiling={tiles}: mxc runs the loss over pieces of each device's "
                           f"{local_seq} tokens of the sequence, which {tiles} pieces do not divide")
    notes.append(f"num_vocab_tiling {tiles}: the output head and loss over {tiles} pieces of the sequence, "
                 "each piece's logits recomputed in the backward pass (mxc's loss_chunks)")
    return tiles


def _optimizer_offload(params, notes: list[str]) -> bool:
    """MaxText's optimizer_memory_host_offload: AdamW's moments kept in host memory between steps
    (MaxText moves the whole optimizer state; mxc its moments, the counters being scalars)."""
    value = params.get("optimizer_memory_host_offload", False)
    if not isinstance(value, bool):
        raise MaxTextError(f"--maxtext optimizer_memory_host_offload={value}: true or false")
    if value:
        notes.append("optimizer_memory_host_offload true: AdamW's moments in host memory between steps, "
                     "brought to HBM for the update and written back")
    return value


def _logits_dot(params, notes: list[str]) -> bool:
    """MaxText's logits_dot_in_fp32 (default false: the output head multiplies in the activations'
    dtype and the logits are cast to float32 for the loss, cast_logits_to_fp32)."""
    value = params.get("logits_dot_in_fp32", False)
    if not isinstance(value, bool):
        raise MaxTextError(f"--maxtext logits_dot_in_fp32={value}: true or false")
    if not value:
        notes.append("logits_dot_in_fp32 false (MaxText's default): the output head multiplies in the "
                     "activations' dtype, its logits cast to float32 for the loss")
    return value


def _pipeline(params, spec, stages: int, steps: int, batch: int, remat: str, notes: list[str]) -> int:
    """MaxText's pipeline keys -> the plan's microbatches; what mxc's pipeline cannot run as
    written is refused: its plans run one repeat (each stage a contiguous block of layers) and
    every microbatch through the pipeline, on device."""
    from mxc.compiler.lower.remat import needs_host_memory
    from mxc.compiler.plan.stages import pipelined_layers

    if steps > 1:
        raise MaxTextError(f"gradient_accumulation_steps {steps} with pipeline stages: mxc's pipeline takes every "
                           "microbatch of the batch (set num_pipeline_microbatches instead)")
    if needs_host_memory(remat):
        raise MaxTextError("remat_policy with offloading and pipeline stages: mxc's pipeline rematerialises whole "
                           "iterations on device and offloads nothing")
    microbatches = params.get("num_pipeline_microbatches", -1)
    if microbatches == -1:  # MaxText's default: one microbatch per stage
        microbatches = stages
        notes.append(f"num_pipeline_microbatches -1: {stages} microbatches, one per stage")
    else:
        microbatches = _positive_int(params, "num_pipeline_microbatches", 1)
        notes.append(f"num_pipeline_microbatches {microbatches}: {microbatches} microbatches through the pipeline")
    if batch % microbatches:
        raise MaxTextError(f"num_pipeline_microbatches {microbatches} does not divide the batch of {batch}")
    segment, layers = pipelined_layers(spec)
    blocks = len(spec.layers[segment].period)  # a segment's layer repeats a period of blocks
    per_stage = layers // stages
    if per_stage < 1:
        raise MaxTextError(f"{stages} pipeline stages for {layers} layers: a stage needs a layer")
    # MaxText's default, 1 layer per stage, runs layers / stages repeats of the stages.
    given = _positive_int(params, "num_layers_per_pipeline_stage", 1)
    if given != per_stage * blocks:
        default = "" if "num_layers_per_pipeline_stage" in params else " (MaxText's default)"
        raise MaxTextError(f"num_layers_per_pipeline_stage {given}{default} asks for {layers * blocks // (stages * given)} "
                           f"repeats of the {stages} pipeline stages; mxc's plans run one repeat: set "
                           f"--maxtext num_layers_per_pipeline_stage={per_stage * blocks} for {stages} stages")
    pipelined = per_stage * stages * blocks
    subset = params.get("pipeline_parallel_layers", -1)
    if subset not in (-1, pipelined):
        raise MaxTextError(f"--maxtext pipeline_parallel_layers={subset}: mxc pipelines the first {pipelined} layers "
                           f"of the largest segment ({layers * blocks}) for {stages} stages")
    notes.append(f"pipeline: {stages} stages, {per_stage * blocks} layers each, one repeat; "
                 f"{layers * blocks - pipelined} layers after the pipeline")
    return microbatches


def _positive_int(params, key: str, default: int) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MaxTextError(f"--maxtext {key}={value}: a positive whole number")
    return value


def _seq(params, spec, seq: int | None, notes: list[str]) -> int:
    target = params.get("max_target_length")
    if target is None:
        if seq is None:
            raise MaxTextError("--maxtext max_target_length=N is needed (or --seq)")
        return seq
    if not isinstance(target, int) or isinstance(target, bool) or target < 1:
        raise MaxTextError(f"--maxtext max_target_length={target}: a positive whole number")
    if seq is not None and seq != target:
        raise MaxTextError(f"--seq {seq} and --maxtext max_target_length={target} disagree")
    if target > spec.max_seq:
        raise MaxTextError(f"--maxtext max_target_length={target} exceeds {spec.name}'s max_seq of {spec.max_seq}")
    notes.append(f"max_target_length {target}: sequences of {target} tokens")
    return target


def _mesh(params, keys, topology, notes: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """MaxText's ici_/dcn_ axes -> mxc's mesh (whole sizes) and its part across slices."""
    per_slice, slices = topology.chips_per_slice, topology.slices
    levels = {"ici": {}, "dcn": {}}
    for key in sorted(keys):
        level, _, rest = key.partition("_")
        name = rest.removesuffix("_parallelism")
        if name not in MESH_AXIS_MAP:
            raise MaxTextError(f"--maxtext {key}: MaxText has no {name} axis; the axes are "
                               f"{', '.join(MESH_AXIS_MAP)}")
        value = params[key]
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise MaxTextError(f"--maxtext {key}={value}: a positive whole number, or -1 for the devices left over")
        levels[level][name] = value
    # MaxText's defaults: fsdp takes the slice's devices left over, data the slices left over.
    if -1 not in levels["ici"].values() and "fsdp" not in levels["ici"]:
        levels["ici"]["fsdp"] = -1
    if -1 not in levels["dcn"].values() and "data" not in levels["dcn"]:
        levels["dcn"]["data"] = -1
    sizes = {}
    for level, total in (("ici", per_slice), ("dcn", slices)):
        given = levels[level]
        free = [name for name, value in given.items() if value == -1]
        if len(free) > 1:
            raise MaxTextError(f"only one {level} axis may be -1; {', '.join(f'{level}_{n}_parallelism' for n in free)} are")
        fixed = math.prod(v for v in given.values() if v != -1)
        if total % fixed:
            raise MaxTextError(f"the {level} axes multiply to {fixed}, which does not divide the "
                               f"{total} {'devices of a slice' if level == 'ici' else 'slices'}")
        for name in free:
            given[name] = total // fixed
            if level == "ici" or total > 1:
                notes.append(f"{level}_{name}_parallelism -1: the {total // fixed} "
                             f"{'devices' if level == 'ici' else 'slices'} left over")
        if math.prod(given.values()) != total:
            raise MaxTextError(f"the {level} axes multiply to {math.prod(given.values())}, not the {total} "
                               f"{'devices of a slice' if level == 'ici' else 'slices'} of {topology.name}")
        sizes[level] = given
    mesh = {"stage": 1, "data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    dcn: dict[str, int] = {}
    for level in ("ici", "dcn"):
        for name, value in sizes[level].items():
            target, why = MESH_AXIS_MAP[name]
            if value == 1:
                continue
            if target is None:
                raise MaxTextError(f"--maxtext {level}_{name}_parallelism={value}: {why}, which mxc's train "
                                   "step does not have")
            mesh[target] *= value
            if level == "dcn":
                dcn[target] = dcn.get(target, 1) * value
            if why:
                notes.append(f"{level}_{name}_parallelism {value} -> mxc's {target} axis ({why})")
    return mesh, dcn


def _remat(params, remat_keys, notes: list[str]) -> str:
    from mxc.compiler.lower import remat

    policy = params.get("remat_policy", "full")
    if not isinstance(policy, str):
        raise MaxTextError(f"--maxtext remat_policy={policy}: a policy name")
    if policy != "custom":
        if remat_keys:
            raise MaxTextError(f"--maxtext {sorted(remat_keys)[0]}: per-name settings need remat_policy=custom "
                               f"(remat_policy is {policy})")
        try:
            remat.saved(policy)
        except ValueError as err:
            raise MaxTextError(f"--maxtext remat_policy={policy}: {err}") from None
        notes.append(f"remat_policy {policy}" + (" (MaxText's default)" if "remat_policy" not in params else ""))
        return policy
    settings: dict[str, str] = {}
    for key in sorted(remat_keys, key=list(REMAT_NAMES).index):
        value = params[key]
        if value not in ("device", "offload", "remat"):
            raise MaxTextError(f"--maxtext {key}={value}: device, offload or remat")
        name = REMAT_NAMES[key]
        if name in settings and settings[name] != value:
            raise MaxTextError(f"--maxtext {key}={value}: mxc tags both gated inputs as {name}, set to "
                               f"{settings[name]} already")
        if value != "remat":
            settings[name] = value
    if not settings:
        notes.append("remat_policy custom with every name rematerialised: mxc's full")
        return "full"
    text = remat.custom(**settings)
    try:
        remat.saved(text)
    except ValueError as err:
        raise MaxTextError(f"--maxtext remat_policy=custom: {err}") from None
    notes.append(f"remat_policy custom: {text}")
    return text


def _attention(params, topology, seq: int, mesh, notes: list[str], ignored: list[str]) -> str | None:
    from mxc.compiler.plan.candidates import attention_for

    value = params.get("attention")
    if value is None or value == "autoselected":
        if value is not None:
            ignored.append("attention")
        return None
    chosen = attention_for(topology, seq, mesh["context"])
    if value == "flash":
        if chosen != "splash":
            raise MaxTextError(f"--maxtext attention=flash: mxc's flash kernel (splash) needs a TPU, whole sequences "
                               f"per device and seq % 128 == 0; {topology.name} with this mesh gets {chosen}")
        notes.append("attention flash: mxc's splash kernel")
        return "splash"
    if value == "dot_product":
        notes.append("attention dot_product: XLA's attention")
        return "xla"
    raise MaxTextError(f"--maxtext attention={value}: mxc compiles flash, dot_product or autoselected")


def _experts(params, moe: bool, topology, notes: list[str], ignored: list[str]):
    given = [k for k in MOE_KEYS if k in params]
    if not moe:
        ignored.extend(given)
        if given:
            notes.append(f"{', '.join(given)}: the model has no MoE layers")
        return None
    if not given:
        return None
    sparse = params.get("sparse_matmul", True)
    megablox = params.get("megablox", True)
    factor = params.get("capacity_factor", -1.0)
    for key, value in (("sparse_matmul", sparse), ("megablox", megablox)):
        if not isinstance(value, bool):
            raise MaxTextError(f"--maxtext {key}={value}: true or false")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise MaxTextError(f"--maxtext capacity_factor={factor}: a number (-1: dropless)")
    if factor > 0:
        if sparse:
            raise MaxTextError(f"--maxtext capacity_factor={factor} with sparse_matmul=true: mxc's capacity path "
                               "runs dense einsums; set sparse_matmul=false")
        notes.append(f"capacity_factor {factor}, sparse_matmul false: mxc's capacity path, "
                     f"each expert taking {factor} x its share of the tokens")
        return "capacity", float(factor)
    if not sparse:
        notes.append("sparse_matmul false without a capacity: mxc's dense path, every expert on every token")
        return "dense", None
    if topology.platform == "tpu" and not megablox:
        raise MaxTextError("--maxtext megablox=false with sparse_matmul=true: on TPU mxc's dropless path runs "
                           "megablox's kernel; ragged_dot there is not compiled")
    notes.append("sparse_matmul true, capacity_factor -1: mxc's dropless path")
    return "dropless", None


def plan_setting(spec, topology, params: dict[str, object], *, seq: int | None = None, batch: int | None = None,
                 verify: bool = True, terms: list | None = None, texts: list | None = None):
    """The Plan for exactly MaxText's setting `params`: compiled for the topology (unless
    `verify` is false) and estimated from the compiled program, as an automatic plan is."""
    from mxc.compiler.plan.plan import Verification
    from mxc.compiler.plan.search import PlanError, evaluate

    chosen = setting(params, spec, topology, seq=seq, batch=batch)
    split = chosen.mesh["data"] * chosen.mesh["fsdp"] * chosen.mesh["expert"]
    if (chosen.batch // chosen.microbatches) % split:
        raise MaxTextError(f"a microbatch of {chosen.batch // chosen.microbatches} sequences does not split over "
                           f"data x fsdp x expert = {split} devices")
    # MaxText shards the activations between layers over tensor (its `activation_embed` rule),
    # so a layer's input, and what is offloaded of it, is 1/tensor per device; mxc's twin is
    # the residual stream's sequence split over tensor (sequence parallelism), the same bytes.
    split_residual = chosen.mesh["tensor"] > 1
    if split_residual:
        chosen.notes.append(f"ici_tensor_parallelism {chosen.mesh['tensor']}: the activations between layers split "
                            "over tensor, as MaxText's activation_embed rule does (mxc: sequence parallelism)")
    try:
        result = evaluate(spec, topology, seq=chosen.seq, batch=chosen.batch, mesh=chosen.mesh, remat=chosen.remat,
                          sequence_parallel=split_residual, microbatches=chosen.microbatches, dcn=chosen.dcn,
                          attention=chosen.attention, experts=chosen.experts, loss_chunks=chosen.loss_chunks,
                          optimizer_on_host=chosen.optimizer_state_on_host)
    except (PlanError, ValueError) as err:
        raise MaxTextError(str(err)) from None
    if result.lowering is not None:
        result = result.model_copy(update={"lowering": result.lowering.model_copy(
            update={"float32_logits_dot": chosen.float32_logits_dot})})
    reasons = [f"maxtext: {note}" for note in chosen.notes]
    if chosen.ignored:
        reasons.append(f"maxtext: ignored, they do not change the program: {', '.join(chosen.ignored)}")
    if verify:
        from mxc.compiler.plan.verify import verify as compile_and_judge

        verdict = compile_and_judge(spec, result, topology, terms=terms, texts=texts)
    else:
        verdict = Verification(status="skipped", reason="--no-verify")
    fits = verdict.status == "fits" or (verdict.status in ("unavailable", "skipped")
                                        and result.predicted.total <= result.hbm_bytes)
    return result.model_copy(update={"xla": verdict, "time": verdict.time or result.time, "fits": fits,
                                     "reasons": reasons + result.reasons})
