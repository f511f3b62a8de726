"""Ahead-of-time compilation: every function of a model, lowered and compiled for one topology.

    compile_artifact(spec, topology, run, plan=None) -> Artifact (manifest without file hashes, {relpath: bytes})

Each function is compiled as a *flat* function of its leaves: the executable's parameters are
exactly the manifest's input leaves, in order, and its results the output leaves. So the runtime
needs no Python tree structures (and no pickle) to call it, and the StableHLO export, whose
trees are plain tuples, serialises without registering any custom pytree type.
`keep_unused=True` keeps an argument the function ignores as a parameter, so leaves and
parameters stay one to one.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from mxc.compiler.lower.optimizer import OptimizerConfig
from mxc.compiler.lower.sharding import named_sharding, use_rules
from mxc.compiler.plan import Plan
from mxc.compiler.plan.plan import Verification, spec_hash
from mxc.compiler.plan.verify import plan_mesh
from mxc.compiler.topology import Topology
from mxc.compiler.xla_options import compiler_options, portable_source_paths
from mxc.runtime.artifact import (FORMAT_VERSION, Cost, Estimate, Function, Leaf, Manifest, Memory,
                                  Topology as TopologyRecord)
from mxc.runtime.artifact_reader import installed_versions
from mxc.spec.ir import ModelSpec

EXPORT_PLATFORMS = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}
# Custom calls jax.export refuses by default because their ABI is not frozen across jax versions.
# An artifact pins jax, jaxlib and libtpu exactly and refuses other versions at load, so the
# guarantee export asks for is given by the manifest instead (the dropless experts' exchange).
UNVERSIONED_CUSTOM_CALLS = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]


# ------------------------------------------------------------------ what is compiled

@dataclass(frozen=True)
class RunConfig:
    """The shapes the functions are compiled for, and the optimizer the train step applies."""

    seq: int
    batch: int  # global, in sequences
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    serve: bool = False
    serve_batch: int = 1
    prompt_len: int = 1
    cache_len: int = 1
    functions: tuple[str, ...] | None = None  # a subset to compile; None: all of them
    images_per_row: int | None = None  # image slots per batch row (a vision model); None: image_slots()

    def to_json(self) -> dict:
        data = {"seq": self.seq, "batch": self.batch, "optimizer": self.optimizer.model_dump(mode="json"),
                "serve": self.serve}
        if self.images_per_row is not None:
            data["images_per_row"] = self.images_per_row
        if self.functions is not None:
            data["functions"] = list(self.functions)
        if self.serve:
            data.update(serve_batch=self.serve_batch, prompt_len=self.prompt_len, cache_len=self.cache_len)
        return data


@dataclass(frozen=True)
class Traceable:
    """A function with the abstract arguments and shardings it is compiled for."""

    name: str
    fn: Callable
    arguments: tuple[str, ...]
    args: tuple  # pytrees of ShapeDtypeStruct
    in_shardings: tuple  # pytrees of NamedSharding, shaped like `args`
    out_shardings: Callable  # output ShapeDtypeStruct tree -> NamedSharding tree
    donate: tuple[int, ...] = ()


def _shapes(tree, dtype=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype), tree)


def _traced_as_planned(plan: Plan, fn: Callable) -> Callable:
    """fn, traced under the plan's lowering choices (not the tracing mesh's platform)."""
    from mxc.compiler.lower.choices import use_lowering

    choices = plan.lowering_choices()

    @functools.wraps(fn)
    def traced(*args):
        with use_lowering(choices):
            return fn(*args)

    return traced


def _register_kernels(plan: Plan) -> None:
    if plan.attention.startswith("splash"):
        import mxc.compiler.lower.splash  # noqa: F401  (registers the kernel with attention_core)


def abstract_batch(batch: int, seq: int, images: tuple[int, ...] | None = None) -> dict:
    """The train and eval steps' batch as ShapeDtypeStructs, each [batch, seq]: inputs, targets,
    mask, and the packed documents' segment_ids and positions (runtime/data.py fills them); with
    `images` (slots, channels, height, width) also pixel_values [batch, slots, channels, height,
    width] and image_mask [batch, slots]; with tiled images (slots, tiles, channels, height, width)
    also aspect_ratio_ids [batch, slots]."""
    shape = (batch, seq)
    out = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32), "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
           "mask": jax.ShapeDtypeStruct(shape, jnp.float32),
           "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32), "positions": jax.ShapeDtypeStruct(shape, jnp.int32)}
    if images is not None:
        out["pixel_values"] = jax.ShapeDtypeStruct((batch, *images), jnp.float32)
        out["image_mask"] = jax.ShapeDtypeStruct((batch, images[0]), jnp.bool_)
        if len(images) == 5:
            out["aspect_ratio_ids"] = jax.ShapeDtypeStruct((batch, images[0]), jnp.int32)
    return out


def image_slots(spec: ModelSpec, images_per_row: int | None = None) -> tuple[int, ...] | None:
    """(slots, channels, height, width) of the batch's images, (slots, tiles, channels, height,
    width) for a tiled tower: None for a model without a vision tower (or zero slots); one slot
    per row unless told otherwise."""
    if spec.vision is None or images_per_row == 0:
        return None
    tower = spec.vision
    tiles = () if tower.tiles is None else (tower.tiles.max,)
    return (1 if images_per_row is None else images_per_row, *tiles, tower.patches.channels, tower.image, tower.image)


def serving_image_inputs(spec: ModelSpec, batch: int, prompt_len: int,
                         images: tuple[int, ...] | None) -> dict | None:
    """What a vision model's prefill takes beside its tokens, as ShapeDtypeStructs: each row's
    images in fixed slots (`images`: image_slots' shape) with image_mask [batch, slots] (False for an
    empty slot); a tiled tower (Llama 3.2 Vision) also takes the processor's aspect_ratio_ids
    [batch, slots], aspect_ratio_mask [batch, slots, tiles] and cross_attention_mask
    [batch, prompt_len, slots, tiles]. None without images."""
    if images is None:
        return None
    slots = images[0]
    out = {"pixel_values": jax.ShapeDtypeStruct((batch, *images), jnp.float32),
           "image_mask": jax.ShapeDtypeStruct((batch, slots), jnp.bool_)}
    if len(images) == 5:
        tiles = images[1]
        out.update(aspect_ratio_ids=jax.ShapeDtypeStruct((batch, slots), jnp.int32),
                   aspect_ratio_mask=jax.ShapeDtypeStruct((batch, slots, tiles), jnp.int32),
                   cross_attention_mask=jax.ShapeDtypeStruct((batch, prompt_len, slots, tiles), jnp.int32))
    return out


def serving_image_record(spec: ModelSpec, run: RunConfig) -> dict | None:
    """The manifest's account of a serving artifact's image slots (run.serve_images), which the
    runtime reads to place a request's images in them: the placeholder or image token, the tokens
    each image fills (a tiled tower's: one image token each), and the slots per row; the arrays'
    shapes are the prefill's inputs."""
    from mxc.compiler.kinds.vision import tokens_per_image
    from mxc.spec.ir import CrossAttentionEntry

    shape = image_slots(spec, run.images_per_row)
    if not run.serve or shape is None:
        return None
    cross = isinstance(spec.vision.entry, CrossAttentionEntry)
    return {"entry": "cross_attention" if cross else "placeholder", "token": spec.vision.entry.token,
            "tokens_per_image": 1 if cross else tokens_per_image(spec.vision), "slots": shape[0]}


def batch_shardings(batch: dict, mesh: Mesh, rules) -> dict:
    """Token arrays split as (batch, seq); image arrays along their rows only."""
    tokens = named_sharding(("batch", "seq"), mesh, rules)
    token_keys = ("inputs", "targets", "mask", "segment_ids", "positions")
    return {key: tokens if key in token_keys else named_sharding(("batch",) + (None,) * (value.ndim - 1), mesh, rules)
            for key, value in batch.items()}


def abstract_schedule() -> dict:
    """The train step's step-dependent scalars, which the runtime computes every step
    (mxc.runtime.schedule): the learning rate of the update."""
    return {"learning_rate": jax.ShapeDtypeStruct((), jnp.float32)}


def train_step_function(spec: ModelSpec, plan: Plan, mesh: Mesh, optimizer: OptimizerConfig,
                        images_per_row: int | None = None) -> Traceable:
    """The train step as compiled, (state, batch, schedule) -> (state, metrics): the one builder
    that `mxc compile` and the planner's verification (mxc.compiler.plan.verify) both use, so that
    XLA judges the program compile writes. A vision model's batch carries images (image_slots)."""
    from mxc.compiler.lower.train import abstract_train_state, make_train_step, train_state_shardings

    _register_kernels(plan)
    rules = plan.rules_tuples()
    replicated = named_sharding((), mesh, rules)
    state_shardings = train_state_shardings(spec, optimizer, mesh, rules,
                                            moments_on_host=plan.lowering_choices().optimizer_state_on_host)
    batch = abstract_batch(plan.batch, plan.seq, image_slots(spec, images_per_row))
    # The plan's expert path (dropless, capacity, megablox) is what XLA's verdict was about.
    step = make_train_step(spec, optimizer, microbatches=plan.microbatches, remat=plan.remat,
                           attention_impl=plan.attention, moe=plan.moe_config(), pipeline=plan.pipeline_layout())
    schedule = abstract_schedule()

    def scheduled_step(state, batch, scalars):
        return step(state, batch, scalars["learning_rate"])

    return Traceable("train_step", _traced_as_planned(plan, scheduled_step), ("state", "batch", "schedule"),
                     (abstract_train_state(spec, optimizer), batch, schedule),
                     (state_shardings, batch_shardings(batch, mesh, rules), jax.tree.map(lambda _: replicated, schedule)),
                     lambda out: (state_shardings, jax.tree.map(lambda _: replicated, out[1])), donate=(0,))


def model_functions(spec: ModelSpec, plan: Plan, mesh: Mesh, run: RunConfig) -> list[Traceable]:
    """init, train_step, eval_step; with run.serve also prefill and decode."""
    from mxc.compiler.lower.train import init_train_state, make_eval_step

    if (run.seq, run.batch) != (plan.seq, plan.batch):
        plan = plan.model_copy(update={"seq": run.seq, "batch": run.batch})
    train_step = train_step_function(spec, plan, mesh, run.optimizer, run.images_per_row)
    abstract_state, batch, _ = train_step.args
    state_shardings, batch_shardings, _ = train_step.in_shardings
    replicated = named_sharding((), mesh, plan.rules_tuples())
    opt = run.optimizer
    eval_step = make_eval_step(spec, attention_impl=plan.attention, moe=plan.moe_config())

    def init(seed):
        return init_train_state(spec, opt, jax.random.key(seed))

    functions = [
        Traceable("init", _traced_as_planned(plan, init), ("seed",), (jax.ShapeDtypeStruct((), jnp.int32),), (replicated,),
                  lambda _: state_shardings),
        train_step,
        Traceable("eval_step", _traced_as_planned(plan, eval_step), ("params", "batch"), (abstract_state.params, batch),
                  (state_shardings.params, batch_shardings), lambda out: jax.tree.map(lambda _: replicated, out)),
    ]
    if run.serve:
        functions += serve_functions(spec, plan, mesh, run, abstract_state.params, state_shardings.params)
    return functions


def serve_functions(spec: ModelSpec, plan: Plan, mesh: Mesh, run: RunConfig, params,
                    params_shardings) -> list[Traceable]:
    from mxc.compiler.kinds.vision import tokens_per_image
    from mxc.compiler.lower.decode import cache_axes, cross_attention_model, init_cache, serving_steps
    from mxc.runtime.layer_layout import per_layer_abstract
    from mxc.compiler.lower.sharding import tree_shardings

    from mxc.compiler.quant.params import serving_params

    rules = plan.rules_tuples()
    params, params_shardings = serving_params(spec, params, params_shardings)  # quantized weights, if any
    batch, length = run.serve_batch, run.cache_len
    # A vision model's prefill takes each row's images in fixed slots (masked where empty).
    slots = image_slots(spec, run.images_per_row)
    images = serving_image_inputs(spec, batch, run.prompt_len, slots)
    cross = images is not None and cross_attention_model(spec)
    image_tokens = slots[0] * tokens_per_image(spec.vision) if cross else None
    cache = jax.eval_shape(lambda: init_cache(spec, batch, length, image_tokens=image_tokens))
    cache_shardings = tree_shardings(cache_axes(spec, image_tokens=cross), mesh, rules)
    # CPUs: one array per layer (layer_layout.py); the cross-attention image path runs stacked only.
    if plan.lowering_choices().serves_per_layer(spec.quantize) and not cross:
        params, params_shardings = per_layer_abstract(params, params_shardings,
                                                      joined=plan.lowering_choices().joined_serving_projections)
        cache, cache_shardings = per_layer_abstract(cache, cache_shardings)
    logits = named_sharding(("batch", "vocab"), mesh, rules)
    tokens = named_sharding(("batch", "seq"), mesh, rules)
    rows = named_sharding(("batch",), mesh, rules)
    attention = "xla" if plan.attention.startswith("splash") else plan.attention  # decode never uses splash
    run_prefill, run_decode = (_traced_as_planned(plan, fn)
                               for fn in serving_steps(spec, batch, length, attention_impl=attention,
                                                       image_slots=images is not None))
    prefill_args = (params, jax.ShapeDtypeStruct((batch, run.prompt_len), jnp.int32),
                    jax.ShapeDtypeStruct((batch,), jnp.int32))
    prefill_shardings = (params_shardings, tokens, rows)
    if images is not None:
        prefill_args += (images,)
        prefill_shardings += (batch_shardings(images, mesh, rules),)

    return [
        Traceable("prefill", run_prefill, ("params", "tokens", "lengths") + (("images",) if images else ()),
                  prefill_args, prefill_shardings, lambda _: (logits, cache_shardings)),
        Traceable("decode", run_decode, ("params", "tokens", "cache"),
                  (params, jax.ShapeDtypeStruct((batch,), jnp.int32), cache),
                  (params_shardings, rows, cache_shardings),
                  lambda _: (logits, cache_shardings), donate=(2,)),
    ]


# ------------------------------------------------------------------ compiling one function

class Stages:
    """Times each stage (wall clock, and CPU time of this process: on a shared machine the wall
    clock measures the neighbours too) and tells an observer, the CLI's progress display, as
    they start and end."""

    def __init__(self, on_start: Callable[[str], None] | None = None,
                 on_end: Callable[[str, float, float], None] | None = None):
        self.on_start = on_start or (lambda label: None)
        self.on_end = on_end or (lambda label, seconds, cpu_seconds: None)
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, label: str) -> Iterator[None]:
        self.on_start(label)
        started, cpu_started = time.perf_counter(), time.process_time()
        yield
        self.seconds[label] = time.perf_counter() - started
        self.cpu_seconds[label] = time.process_time() - cpu_started
        self.on_end(label, self.seconds[label], self.cpu_seconds[label])


def _path_entry(key) -> str | int:
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    if isinstance(key, jax.tree_util.DictKey):
        return key.key if isinstance(key.key, (str, int)) else str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return key.key
    raise TypeError(f"unsupported pytree key {key!r}")


def _spec_entries(sharding: NamedSharding, ndim: int) -> list:
    entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def _leaves(paths_and_values, shardings, donated_args=()) -> list[Leaf]:
    leaves = []
    for (path, value), sharding in zip(paths_and_values, shardings):
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"expected a NamedSharding for {path}, got {sharding!r}")
        entries = [_path_entry(k) for k in path]
        leaves.append(Leaf(path=entries, shape=list(value.shape), dtype=jnp.dtype(value.dtype).name,
                           sharding=_spec_entries(sharding, len(value.shape)),
                           donated=bool(entries) and entries[0] in donated_args,
                           memory_kind="pinned_host" if sharding.memory_kind == "pinned_host" else "device"))
    return leaves


def _memory(compiled) -> Memory:
    stats = compiled.memory_analysis()
    argument, output = stats.argument_size_in_bytes, stats.output_size_in_bytes
    alias, temp = stats.alias_size_in_bytes, stats.temp_size_in_bytes
    return Memory(argument_bytes=argument, output_bytes=output, alias_bytes=alias, temp_bytes=temp,
                  generated_code_bytes=stats.generated_code_size_in_bytes,
                  total_bytes=argument + output - alias + temp)


def _cost(compiled) -> Cost:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # one entry per program on older jaxlibs
        analysis = analysis[0] if analysis else None
    if not analysis:
        return Cost(flops=None, bytes_accessed=None)
    return Cost(flops=analysis.get("flops"), bytes_accessed=analysis.get("bytes accessed"))


@dataclass(frozen=True)
class CompiledFunction:
    function: Function
    executable: bytes
    export: bytes


@dataclass(frozen=True)
class LoweredFunction:
    """A Traceable lowered as a flat function of its leaves (see the module's docstring)."""

    jitted: Callable
    avals: list  # ShapeDtypeStructs with their shardings, one per input leaf
    inputs: list[Leaf]
    outputs: list[Leaf]
    lowered: object  # jax.stages.Lowered


def lower_function(traceable: Traceable, mesh: Mesh, rules, stages: Stages | None = None) -> LoweredFunction:
    stages = stages or Stages()
    in_flat, in_tree = jax.tree_util.tree_flatten_with_path(traceable.args)
    in_shardings = in_tree.flatten_up_to(traceable.in_shardings)
    with use_rules(mesh, rules):
        out_shape = jax.eval_shape(traceable.fn, *traceable.args)
    out_flat, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    out_shardings = out_tree.flatten_up_to(traceable.out_shardings(out_shape))
    # The top level of an input path is the argument's index.
    inputs = _leaves(in_flat, in_shardings, traceable.donate)
    outputs = _leaves(out_flat, out_shardings)

    def flat(*leaves):
        return tuple(jax.tree.leaves(traceable.fn(*in_tree.unflatten(leaves))))

    jitted = jax.jit(flat, in_shardings=tuple(in_shardings), out_shardings=tuple(out_shardings),
                     donate_argnums=tuple(i for i, leaf in enumerate(inputs) if leaf.donated),
                     keep_unused=True)
    avals = [jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
             for (_, value), sharding in zip(in_flat, in_shardings)]
    with use_rules(mesh, rules), stages.stage(f"{traceable.name}: lower"):
        lowered = jitted.lower(*avals)
    return LoweredFunction(jitted, avals, inputs, outputs, lowered)


def compile_function(traceable: Traceable, mesh: Mesh, rules, platform: str, stages: Stages,
                     options: dict | None = None) -> CompiledFunction:
    name = traceable.name
    lowered = lower_function(traceable, mesh, rules, stages)
    seconds = {}
    with use_rules(mesh, rules):
        with stages.stage(f"{name}: compile"):
            compiled = lowered.lowered.compile(compiler_options=options or None)
            executable_bytes = bytes(compiled.runtime_executable().serialize())
        with stages.stage(f"{name}: export"):
            exported = jax.export.export(lowered.jitted, platforms=[EXPORT_PLATFORMS[platform]],
                                         disabled_checks=UNVERSIONED_CUSTOM_CALLS)(*lowered.avals)
            export_bytes = bytes(exported.serialize())
    for stage in ("lower", "compile", "export"):
        seconds[stage] = round(stages.seconds[f"{name}: {stage}"], 3)
        seconds[f"{stage}_cpu"] = round(stages.cpu_seconds[f"{name}: {stage}"], 3)
    function = Function(name=name, arguments=list(traceable.arguments), executable=f"{name}.executable",
                        export=f"{name}.stablehlo", inputs=lowered.inputs, outputs=lowered.outputs,
                        donation=list(traceable.donate), memory=_memory(compiled), cost=_cost(compiled),
                        seconds=seconds)
    return CompiledFunction(function, executable_bytes, export_bytes)


# ------------------------------------------------------------------ the whole artifact

def topology_record(topology: Topology, mesh: Mesh) -> TopologyRecord:
    devices = list(mesh.devices.flat)
    coords = [list(d.coords) for d in devices] if all(hasattr(d, "coords") for d in devices) else None
    chips = topology.chips or len(devices)  # `local`: whatever is attached
    return TopologyRecord(
        name=topology.name, platform=devices[0].platform if topology.name == "local" else topology.platform,
        chip=topology.chip.name, device_kind=devices[0].device_kind, chips=chips, devices=len(devices),
        slices=topology.slices, hosts=topology.hosts, hbm_bytes=topology.hbm_bytes,
        usable_hbm_bytes=topology.usable_hbm_bytes,
        shape=list(topology.shape) or [len(devices)], mesh={k: int(v) for k, v in mesh.shape.items()},
        device_ids=[d.id for d in devices], device_coords=coords)


def estimate(spec: ModelSpec, topology: TopologyRecord, chip_peak_flops: float, run: RunConfig,
             plan: Plan) -> Estimate:
    from mxc.compiler.analysis import summarize

    tokens = run.batch * run.seq
    flops = summarize(spec, run.seq).train_flops_per_token * tokens
    per_device = flops / topology.devices
    peak = chip_peak_flops * topology.chips / topology.devices
    return Estimate(tokens_per_step=tokens, train_flops_per_step=flops, flops_per_device=per_device,
                    peak_flops_per_device=peak, step_seconds_at_peak=per_device / peak,
                    step_seconds=plan_step_seconds(plan))


def plan_step_seconds(plan: Plan) -> float | None:
    return None if plan.time is None else float(plan.time.step_s)


def plan_json(plan: Plan) -> dict:
    return plan.to_json()


def judged_plan(plan: Plan, train_step: Function | None, usable_hbm: int, seconds: float) -> Plan:
    """The plan with XLA's verdict from this compile of its train step (the planner left it
    unjudged: compiling the artifact is the judgement)."""
    if train_step is None:
        return plan
    from mxc.compiler.commands.units import size_bytes

    needed = train_step.memory.total_bytes
    status = "fits" if needed <= usable_hbm else "over_hbm"
    reason = (f"mxc compile: the train step needs {size_bytes(needed)} per device of "
              f"{size_bytes(usable_hbm)} usable")
    verdict = Verification(status=status, reason=reason, compile_seconds=round(seconds, 1))
    return plan.model_copy(update={"xla": verdict, "fits": status == "fits"})


def build_artifact(spec: ModelSpec, topology: Topology, devices: list, plan: Plan, run: RunConfig,
                   stages: Stages | None = None) -> tuple[Manifest, dict[str, bytes]]:
    """Compile the run's functions; the manifest's `files` is filled in by the writer."""
    stages = stages or Stages()
    started = time.perf_counter()
    mesh = plan_mesh(plan, topology, devices)
    record = topology_record(topology, mesh)
    rules = plan.rules_tuples()
    options = compiler_options(spec, record.platform, dict(mesh.shape))
    functions, files = {}, {}
    for traceable in model_functions(spec, plan, mesh, run):
        if run.functions is not None and traceable.name not in run.functions:
            continue
        compiled = compile_function(traceable, mesh, rules, record.platform, stages, options)
        functions[traceable.name] = compiled.function
        files[compiled.function.executable] = compiled.executable
        files[compiled.function.export] = compiled.export
    spec_json = spec.model_dump(mode="json")
    train_step = functions.get("train_step")
    usable_per_device = topology.usable_hbm_bytes * record.chips // record.devices
    plan = judged_plan(plan, train_step, usable_per_device,
                       0.0 if train_step is None else train_step.seconds.get("compile", 0.0))
    manifest = Manifest(
        format_version=FORMAT_VERSION, model=spec.name, spec=spec_json, spec_hash=spec_hash(spec),
        plan=plan_json(plan), run=_run_record(spec, run), topology=record, versions=installed_versions(),
        functions=functions, files={}, estimate=estimate(spec, record, topology.chip.peak_bf16_flops, run, plan),
        compiler_options=options, compile_seconds=round(time.perf_counter() - started, 3),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return manifest, files


def _run_record(spec: ModelSpec, run: RunConfig) -> dict:
    record = run.to_json()
    serve_images = serving_image_record(spec, run)
    if serve_images is not None:
        record["serve_images"] = serve_images
    return record


@dataclass(frozen=True)
class Artifact:
    """What compile_artifact returns: the manifest (its `files` hashes are filled in by
    mxc.compiler.artifact_writer.write_artifact) and every file's bytes."""

    manifest: Manifest
    files: dict[str, bytes]


def target_devices(topology: Topology) -> list:
    """The devices to compile for: a TPU slice as libtpu describes it, GPUs as the CUDA plugin
    describes them, the host's CPU devices. Raises TopologyError where they cannot be had."""
    from mxc.compiler.topology import devices

    if topology.platform == "gpu":
        from mxc.compiler.gpu_target import gpu_devices

        return gpu_devices(topology)
    return devices(topology)


def compile_artifact(spec: ModelSpec, topology: Topology, run: RunConfig, plan: Plan | None = None, *,
                     devices: list | None = None, stages: Stages | None = None) -> Artifact:
    """The compiler's entry point (`mxc compile`, the tests): plan the model unless `plan` is
    given (the planner does not compile candidates here: compiling the artifact is XLA's verdict
    on the plan), then lower and compile every function of `run` for `topology`."""
    from mxc.compiler.plan import plan as make_plan

    devices = target_devices(topology) if devices is None else devices
    if plan is None:
        plan = make_plan(spec, topology, seq=run.seq, batch=run.batch, verify=False)
    with portable_source_paths():  # no build-host paths in the executables' HLO locations
        return Artifact(*build_artifact(spec, topology, devices, plan, run, stages))
