"""The candidates of a search: every mesh factorisation, remat policy and microbatch count the pins
allow, each scored with its predicted memory and step time, and the order they are tried in."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterator, Mapping, NamedTuple

from mxc.compiler.commands.units import size_bytes
from mxc.compiler.kinds import kind_of
from mxc.compiler.plan import cost, memory
from mxc.compiler.plan.activations import megablox_layout
from mxc.compiler.plan.choice import Choice
from mxc.compiler.plan.layout import Parameters
from mxc.compiler.plan.plan import MESH_AXES, Memory, StepTime
from mxc.compiler.plan.rules import SEQUENCE_PARALLEL, make_rules, sequence_parallel
from mxc.compiler.plan.stages import adjust_time, stage_counts, stage_policy, with_stage_rules
from mxc.compiler.topology import Topology
from mxc.spec.ir import ModelSpec

# MoE layers train dropless wherever the mesh splits the experts (each device sends its tokens to
# their experts' devices, mxc.compiler.lower.expert_dispatch) or every device splits the batch
# (each sorts its own tokens for the grouped matmul). The capacity path, with MaxText's
# dropping recipes' factor, is the fallback the search takes only where no dropless candidate
# fits (and what a recipe's --maxtext capacity_factor asks for).
CAPACITY_FACTOR = 1.25
MAX_TENSOR = 16  # beyond this the per-layer all-reduces cost more than any memory they save
MAX_CONTEXT = 8
# Context parallelism splits sequences into pieces of at least this many tokens (shorter pieces
# leave attention's key/value all-gathers dominating).
MIN_CONTEXT_PIECE = 2048
# The search also tries the output head and loss over pieces of the sequence
# (LoweringChoices.loss_chunks) where one microbatch's float32 logits take at least this share of
# HBM (Llama 3.1 8B on v6e-256 with 4 sequences of 8192 per device: 15.66 GiB of 31.24, which XLA
# could not fit beside MaxText's offloaded stacks), in pieces of at most LOSS_PIECE_SHARE of HBM.
LOGITS_WORTH_CHUNKING = 1 / 8
LOSS_PIECE_SHARE = 1 / 32


class Scored(NamedTuple):
    choice: Choice
    memory: Memory
    time: StepTime
    squeezed_to: float | None = None  # memory.predict_squeezed's irreducible temporaries


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def remat_policies(topology: Topology) -> list[str]:
    from mxc.compiler.lower.remat import CUSTOM, POLICY_NAMES, custom, needs_host_memory

    offload = "offload"
    names = [name for name in POLICY_NAMES if name != CUSTOM] + [
        # MaxText's custom recipes: each layer's input offloaded, alone or with the attention
        # projections (Llama 3.1 70B on v6e: q/k/v; 8B and 405B: q/k/v and out).
        custom(decoder_layer_input=offload),
        custom(decoder_layer_input=offload, query_proj=offload, key_proj=offload, value_proj=offload),
        custom(decoder_layer_input=offload, query_proj=offload, key_proj=offload, value_proj=offload,
               out_proj=offload),
    ]
    # Offloading to host memory is a TPU feature of XLA here; other targets keep everything on device.
    return [name for name in names if topology.platform == "tpu" or not needs_host_memory(name)]


def attention_for(topology: Topology, seq: int, context: int, spec: ModelSpec | None = None) -> str:
    # Splash attention needs TPU, tiles of 128 and the whole sequence on each device; a model
    # whose images attend bidirectionally (Gemma 3) needs the xla path's image blocks.
    images = spec is not None and spec.vision is not None and spec.vision.entry.bidirectional
    if topology.platform == "tpu" and context == 1 and seq % 128 == 0 and not images:
        return "splash"
    return "xla"


def meshes(spec: ModelSpec, topology: Topology, seq: int, pins: Mapping[str, int]):
    """(mesh, dcn) pairs: whole axis sizes and the factor of each that spans slices."""
    chips, slices = topology.chips, topology.slices
    heads = [b.attention.heads for b in spec.blocks.values()]
    routings = [kind_of(b.mlp).routing(b.mlp) for b in spec.blocks.values()]
    experts = [r.experts for r in routings if r is not None]
    options = {
        "tensor": [t for t in divisors(chips) if t <= MAX_TENSOR and all(h % t == 0 for h in heads)],
        "expert": [e for e in divisors(chips) if all(x % e == 0 for x in experts)] if experts else [1],
        "context": [c for c in range(1, MAX_CONTEXT + 1)
                    if c == 1 or (c & (c - 1) == 0 and chips % c == 0 and seq % c == 0
                                  and seq // c >= MIN_CONTEXT_PIECE)],
    }
    options["stage"] = stage_counts(spec, topology, pins)
    for axis, size in pins.items():
        options[axis] = [size]
    seen = set()
    for stage, tensor, expert, context in itertools.product(options["stage"], options["tensor"], options["expert"],
                                                            options["context"]):
        rest, remainder = divmod(chips, stage * tensor * expert * context)
        if remainder:
            continue
        for data in divisors(rest):
            mesh = {"stage": stage, "data": data, "fsdp": rest // data, "context": context, "expert": expert,
                    "tensor": tensor}
            if any(mesh[axis] != size for axis, size in pins.items()):
                continue
            # Slices join over DCN along pipeline stages, data (pure data parallelism between
            # slices) or fsdp.
            spans = [axis for axis in ("stage", "data", "fsdp") if mesh[axis] % slices == 0] if slices > 1 else [None]
            for axis in spans:
                dcn = {axis: slices} if axis else {}
                key = (tuple(mesh.values()), tuple(dcn.items()))
                if key not in seen:
                    seen.add(key)
                    yield mesh, dcn


def choices(spec: ModelSpec, params: Parameters, topology: Topology, seq: int, batch: int,
            pins: Mapping[str, int], remat: str | None = None, microbatches: int | None = None) -> Iterator[Choice]:
    pinned_rules = {k: tuple(v) for k, v in spec.shard.items()}
    policies = [remat] if remat else remat_policies(topology)
    for mesh, dcn in meshes(spec, topology, seq, pins):
        try:
            rules, notes = make_rules(mesh, params.tensors, pinned_rules)
        except ValueError:  # a pinned rule this mesh would split unevenly
            continue
        rules = with_stage_rules(rules, mesh, params.tensors)
        base = Choice(spec, params, topology, mesh, dcn, rules, seq, batch, 1, policies[0],
                      attention_for(topology, seq, mesh["context"], spec), tuple(notes))
        split = base.split("batch")
        layouts = [replace(base, expert_path=path, capacity_factor=factor) for path, factor in expert_settings(base)]
        if sequence_parallel_applies(mesh, seq, pinned_rules):
            layouts += [replace(layout, rules={**rules, "residual_seq": SEQUENCE_PARALLEL}) for layout in layouts]
        for count in [microbatches] if microbatches else divisors(batch):
            if batch % count or (batch // count) % split:
                continue
            for layout in layouts:
                # The loss over the whole logits, and over pieces where the logits matter: the
                # pieces cost a head matmul, so they win only where they let a faster plan fit.
                chunks = loss_chunks_for(replace(layout, microbatches=count))
                for policy in [p for p in policies if stage_policy(p, mesh)]:
                    for pieces in sorted({1, chunks}):
                        yield replace(layout, microbatches=count, remat=policy, loss_chunks=pieces)


def loss_chunks_for(choice: Choice) -> int:
    """Pieces of the sequence the loss runs over: 1 (the whole logits) where the float32 logits are
    small next to HBM; else the fewest, by powers of two dividing a device's piece of the
    sequence, that bring a piece's logits within LOSS_PIECE_SHARE of HBM. The backward recomputes
    each piece's logits, one more head matmul (a few percent of a step: 2% for Llama 3.1 8B)."""
    whole, hbm = memory.logits_bytes(choice), choice.topology.usable_hbm_bytes
    if whole < LOGITS_WORTH_CHUNKING * hbm:
        return 1
    local_seq, chunks = choice.seq // choice.split("seq"), 1
    while whole / chunks > LOSS_PIECE_SHARE * hbm and local_seq % (2 * chunks) == 0:
        chunks *= 2
    return chunks


def without_needless_pieces(scored: list[Scored], hbm: int) -> list[Scored]:
    """The candidates less those with the loss in pieces whose twin over the whole logits is
    predicted to fit in HBM: the pieces are for plans the logits keep out of HBM. (Ranked by the
    formula alone, Llama 3.1 8B on v6e-256 took fsdp 256, minimal_with_context, 4 microbatches in
    8 pieces, 50.8% by the formula but 35.6% by its twin's compiled program, over MaxText's mesh and
    policy over the whole logits, 48.3% by the formula and 50.5% compiled; docs/plans.md.)"""
    def twin(choice: Choice) -> tuple:
        return (choice.mesh_key(), tuple(sorted(choice.dcn.items())), choice._keys[0], choice.microbatches,
                choice.remat, choice.attention, choice.expert_path, choice.capacity_factor)

    whole_fits = {twin(s.choice) for s in scored if s.choice.loss_chunks == 1 and s.memory.total <= hbm}
    return [s for s in scored if s.choice.loss_chunks == 1 or twin(s.choice) not in whole_fits]


def with_optimizer_on_host(scored: list[Scored], hbm: int) -> list[Scored]:
    """The candidates, and for each predicted not to fit in HBM its twin with AdamW's moments in
    host memory (Choice.optimizer_on_host) where that saving would make it fit, on TPUs whose
    hosts' memory mxc knows: the lever pays the moments' trip over the host link every step, so it
    is for plans the state keeps out of HBM (MaxText's optimizer_memory_host_offload; the host
    budget is checked as for offloaded activations, memory.host_budget)."""
    def worth_a_twin(s: Scored) -> bool:  # over HBM, and within it with the moments' saving
        if (s.memory.total <= hbm or s.choice.optimizer_on_host or s.choice.topology.platform != "tpu"
                or s.choice.topology.chip.name not in memory.HOST_MEMORY_PER_CHIP):
            return False
        saved = (1 - memory.MOMENTS_IN_HBM_WHEN_ON_HOST) * memory.hosted_moment_bytes(s.choice)
        return hbm >= s.memory.total - saved

    return scored + [score(replace(s.choice, optimizer_on_host=True)) for s in scored if worth_a_twin(s)]


def condemned_with_moments_on_host(item: Scored, refused: list) -> str:
    """Why an earlier refusal passes over `item` for keeping AdamW's moments on host ("" where none
    does): `refused` holds (candidate, its verdict) for the candidates XLA refused. A refusal of an
    on-host candidate that is not for memory (libtpu rejecting the host layouts: DeepSeek V3 671B on
    v5p-1024 before optimizer.host_tiles_accept, all 8 candidates of --attempts 8 with one
    bitcast error) speaks against the lever, not the mesh, so the other on-host candidates go."""
    if not item.choice.optimizer_on_host:
        return ""
    for other, verdict in refused:
        if other.choice.optimizer_on_host and verdict.status == "rejected" and not verdict.out_of_memory:
            return (f"passed over: XLA refused {describe(other.choice)} with AdamW's moments on host, "
                    f"not for memory ({verdict.reason[:120]}); this one keeps them there too")
    return ""


def sequence_parallel_applies(mesh: Mapping[str, int], seq: int, pinned_rules: Mapping) -> bool:
    """Whether splitting the residual stream's sequence over tensor is a distinct candidate: there
    is a tensor axis, the sequence divides over it and context, and the spec does not pin it."""
    pieces = mesh["tensor"] * mesh["context"]
    return mesh["tensor"] > 1 and seq % pieces == 0 and "residual_seq" not in pinned_rules


def expert_settings(choice: Choice) -> list[tuple[str | None, float | None]]:
    """The (expert path, capacity factor) settings to try for the model's MoE layers on the
    choice's layout, preferred first: dropless where the rules split the experts, then the
    capacity path; [(None, None)] without MoE layers."""
    spec = choice.spec
    if not any(kind_of(block.mlp).routing(block.mlp) is not None for block in spec.blocks.values()):
        return [(None, None)]
    # Not with pipeline stages: the dispatch's shard_map inside the stages' vmap is not tested.
    expert_parallel = choice.split("experts") > 1 and choice.mesh.get("stage", 1) == 1
    # Unsplit experts: each batch shard sorts its own tokens for the grouped matmul, which on TPU
    # (megablox, a Pallas kernel) needs a region manual over every mesh axis: only layouts whose
    # other axes all split the batch or the experts' hidden units (activations.megablox_layout).
    per_batch_shard = all(megablox_layout(name, choice) for name, block in spec.blocks.items()
                          if kind_of(block.mlp).routing(block.mlp) is not None)
    dropless = expert_parallel or per_batch_shard
    return ([("dropless", None)] if dropless else []) + [("capacity", CAPACITY_FACTOR)]


def on_capacity_path(item: Scored) -> bool:
    """Whether a candidate drops tokens (the fallback where no dropless candidate fits)."""
    return item.choice.expert_path == "capacity"


def score(choice: Choice) -> Scored:
    predicted, squeezed_to = memory.predict_squeezed(choice)
    return Scored(choice, predicted, adjust_time(choice, cost.step_time(choice)), squeezed_to)


def fits(item: Scored, hbm: int) -> bool:
    """Predicted to fit in HBM, with what it offloads within the host's memory."""
    return item.memory.total <= hbm and item.memory.host <= memory.host_budget(item.choice)


def rank(item: Scored) -> tuple:
    from mxc.compiler.lower.remat import needs_host_memory

    # Fastest first; at equal speed fewer microbatches, no memory lever (offloading, sequence
    # parallelism), then less memory.
    return (round(item.time.step_s, 6), item.choice.microbatches, needs_host_memory(item.choice.remat),
            sequence_parallel(item.choice.rules), item.choice.optimizer_on_host, item.memory.total)


def uses_memory_lever(item: Scored) -> bool:
    from mxc.compiler.lower.remat import needs_host_memory

    return (needs_host_memory(item.choice.remat) or sequence_parallel(item.choice.rules)
            or item.choice.optimizer_on_host)


def fastest_fitting(spec: ModelSpec, params: Parameters, topology: Topology, seq: int, batch: int,
                    pins: Mapping[str, int]) -> Scored | None:
    best = None
    for choice in choices(spec, params, topology, seq, batch, pins):
        predicted, squeezed_to = memory.predict_squeezed(choice)
        if predicted.total <= topology.usable_hbm_bytes and predicted.host <= memory.host_budget(choice):
            item = Scored(choice, predicted, adjust_time(choice, cost.step_time(choice)), squeezed_to)
            if best is None or rank(item) < rank(best):
                best = item
    return best


def describe(choice: Choice) -> str:
    mesh = ", ".join(f"{a} {choice.mesh[a]}" for a in MESH_AXES if choice.mesh.get(a, 1) > 1) or "one device"
    layout = " (sequence-parallel)" if sequence_parallel(choice.rules) else ""
    loss = f"; loss in {choice.loss_chunks} pieces" if choice.loss_chunks > 1 else ""
    moments = "; optimizer state on host" if choice.optimizer_on_host else ""
    return (f"{mesh}{layout}; remat {choice.remat}; "
            f"{choice.microbatches} microbatch{'es' if choice.microbatches > 1 else ''}{loss}{moments}")


def mesh_text(choice: Choice) -> str:
    return describe(choice).split(";")[0]


def gib(value: float) -> str:
    return size_bytes(value)  # the unit that fits the value (units.py), not always GiB
