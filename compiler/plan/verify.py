"""XLA judges a plan: compile the train step for the real topology and read its memory analysis.

The train step is built and lowered by mxc.compiler.aot, as `mxc compile` does, and compiled
with the same XLA options: what the planner verifies is what compile writes.
"""

from __future__ import annotations

import math
import os
import re
import time
import jax

from mxc.compiler.commands.units import size_bytes
from mxc.compiler.plan.plan import MESH_AXES, OUT_OF_HBM, Plan, Verification, XlaMemory
from mxc.compiler.topology import Topology, TopologyError, device_mesh, devices
from mxc.compiler.xla_options import compiler_options
from mxc.spec.ir import ModelSpec


def plan_mesh(plan: Plan, topology: Topology, found: list | None = None):
    """The plan's jax Mesh on the topology's devices (physical torus aware, hybrid over slices)."""
    return device_mesh(topology, MESH_AXES, plan.ici_sizes(), plan.dcn_sizes(), found)


def lower_train_step(spec: ModelSpec, plan: Plan, mesh, optimizer=None):
    """(lowered train step, abstract train state, state shardings) for the plan on `mesh`: the
    train step `mxc compile` writes (mxc.compiler.aot builds and lowers it for both)."""
    from mxc.compiler.aot import lower_function, train_step_function
    from mxc.compiler.lower.optimizer import OptimizerConfig

    train_step = train_step_function(spec, plan, mesh, optimizer or OptimizerConfig())
    lowered = lower_function(train_step, mesh, plan.rules_tuples()).lowered
    return lowered, train_step.args[0], train_step.in_shardings[0]


def _shard_bytes(abstract, shardings) -> int:
    """One device's bytes of the arrays in device memory (a plan's optimizer state kept in host
    memory is not HBM's)."""
    import jax

    total = 0
    for value, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        if sharding.memory_kind != "pinned_host":
            total += math.prod(sharding.shard_shape(value.shape)) * value.dtype.itemsize
    return total


# libtpu's compile-time out-of-memory message: "... the total memory required for HLO
# temporaries (56.59G) exceeds available HBM (31.24G)" (G: GiB).
_OOM = re.compile(r"required for HLO temporaries \(([\d.]+[KMGT])\) exceeds available HBM \(([\d.]+[KMGT])\)")


def _first_line(err: Exception) -> str:
    text = str(err)
    match = _OOM.search(text)
    if match:
        return f"{OUT_OF_HBM}, its temporaries need {match[1]}iB of {match[2]}iB available"
    line = next((l for l in text.splitlines() if l.strip()), type(err).__name__)
    return f"XLA: {line[:300]}"


def program_estimate(spec: ModelSpec, plan: Plan, topology: Topology, compiled, mesh, texts: list | None = None):
    """(step time, the program's cost terms) of a compiled train step: its HLO read by
    mxc.compiler.plan.hlo_cost, sized for the topology's chip (mxc.compiler.plan.cost)."""

    text = compiled.as_text()
    if texts is not None:
        texts.append(text)
    return estimate_from_text(spec, plan, topology, text, mesh)


def grouped_rows(plan: Plan) -> float:
    """The share of a grouped-matmul kernel's row buffer that holds assignments, for the reader
    (hlo_cost.grouped_matmul_cost). The expert-parallel dispatch's receive buffer has room for
    every sender's assignments, shards times a device's own (expert_dispatch.py); under balanced
    routing a device receives as many as it sends, 1/shards of it. Elsewhere the sorted rows are
    exactly the assignments."""
    if plan.expert_path != "dropless":
        return 1.0
    return 1.0 / math.prod(plan.mesh.get(axis, 1) for axis in plan.rules.get("experts", []))


def estimate_from_text(spec: ModelSpec, plan: Plan, topology: Topology, text: str, mesh):
    """(step time, cost terms) of a compiled train step's HLO text, its devices laid out as `mesh`."""
    from mxc.compiler.analysis import attention_flops_per_token, summarize
    from mxc.compiler.plan.cost import attention_mxu_factor, device_places, program_step_time, program_terms
    from mxc.compiler.plan.hlo_cost import program_cost
    from mxc.compiler.plan.stages import reported

    devices = list(mesh.devices.flat)
    program = program_cost(text, len(devices), grouped_rows=grouped_rows(plan))
    tokens = plan.batch * plan.seq / len(devices)
    model_flops = summarize(spec, plan.seq).train_flops_per_token * tokens
    # A Pallas attention kernel is opaque to the HLO: its FLOPs as the kernel runs them, the
    # backward recomputing the scores (7 matmul passes where the model count has 6), each as
    # long as the MXUs take with the head dimension padded to their width.
    hidden = 0.0
    if plan.attention.startswith("splash"):
        per_token = sum(attention_flops_per_token(att, plan.seq) * attention_mxu_factor(att, topology.chip)
                        for att in (spec.blocks[kind].attention for kind in spec.layer_kinds))
        hidden = per_token * tokens * 7 / 6
    terms = program_terms(program, device_places(devices), topology.chip, model_flops, tokens,
                          extra_flops=hidden, microbatches=plan.microbatches)
    # A pipeline's bubble iterations are in the compiled program: its time holds them already.
    return reported(plan.pipeline, program_step_time(terms)), terms


def verify(spec: ModelSpec, plan: Plan, topology: Topology, found: list | None = None,
           terms: list | None = None, texts: list | None = None) -> Verification:
    """Compile the plan's train step for the topology; 'fits' when XLA's peak is within HBM. The
    verdict carries the step time estimated from the compiled program; `terms` (a list) receives
    the program's cost terms, `texts` its HLO text."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        found = devices(topology) if found is None else found
    except TopologyError as err:
        return Verification(status="unavailable", reason=str(err))
    start = time.monotonic()
    try:
        mesh = plan_mesh(plan, topology, found)
        lowered, abstract_state, shardings = lower_train_step(spec, plan, mesh)
        # The options `mxc compile` uses, so that the verdict is about the same program.
        compiled = lowered.compile(compiler_options=compiler_options(spec, mesh.devices.flat[0].platform, dict(mesh.shape)) or None)
    except Exception as err:  # XLA refusing the program (out of memory, unsupported) is a verdict
        return Verification(status="rejected", reason=_first_line(err),
                            compile_seconds=round(time.monotonic() - start, 1))
    seconds = round(time.monotonic() - start, 1)
    stats = compiled.memory_analysis()
    if stats is None:
        return Verification(status="unavailable", reason="XLA gives no memory analysis for this platform",
                            compile_seconds=seconds)
    try:
        estimate, program = program_estimate(spec, plan, topology, compiled, mesh, texts)
    except jax.errors.JaxRuntimeError:
        # XLA cannot print some compiled programs (Mixtral on v5p-256: "async-update instruction
        # should have 1 operands but sees 3"): the plan keeps the formula's estimate.
        estimate, program = None, None
    if terms is not None and program is not None:
        terms.append(program)
    state = _shard_bytes(abstract_state, shardings)
    parameters = _shard_bytes(abstract_state.params, shardings.params)
    memory = XlaMemory(
        parameters=parameters, optimizer_state=state - parameters,
        batch=stats.argument_size_in_bytes - state,
        temporaries=stats.temp_size_in_bytes,
        outputs=stats.output_size_in_bytes - stats.alias_size_in_bytes,
        generated_code=stats.generated_code_size_in_bytes,
        # Host memory the step holds: offloaded activations, and the optimizer state a plan keeps
        # there (an argument in host memory; XLA's peak counts both).
        host_temporaries=stats.host_temp_size_in_bytes + stats.host_argument_size_in_bytes,
        peak=getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if memory.total > plan.hbm_bytes:
        return Verification(status="over_hbm", memory=memory, compile_seconds=seconds, time=estimate,
                            reason=f"{OUT_OF_HBM}, its peak {size_bytes(memory.total)} exceeds "
                                   f"{size_bytes(plan.hbm_bytes)}")
    return Verification(status="fits", memory=memory, compile_seconds=seconds, time=estimate)


def estimate_on_stand_in(spec: ModelSpec, plan: Plan, topology: Topology, stand_in: Topology,
                         texts: list | None = None):
    """(step time, cost terms) of the plan on `topology`, read from its train step compiled for
    `stand_in`, a topology of as many devices with more HBM: for a setting XLA refuses on the
    real chip for memory, the program's kernels and collectives are still what they would be
    there. The terms are sized for the real chip, its collectives on the real devices' links."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if stand_in.chips != topology.chips or stand_in.slices != topology.slices:
        raise ValueError(f"a stand-in for {topology.name} needs its {topology.chips} devices in {topology.slices} slices")
    mesh = plan_mesh(plan, stand_in)
    lowered, _, _ = lower_train_step(spec, plan, mesh)
    compiled = lowered.compile(compiler_options=compiler_options(spec, mesh.devices.flat[0].platform, dict(mesh.shape)) or None)
    return program_estimate(spec, plan, topology, compiled, plan_mesh(plan, topology), texts)
