"""What one compiled program does, read from its optimized HLO text: FLOPs and HBM bytes per
top-level op, every collective with its replica groups and bytes, host-offload copies, each
counted as often as it runs.

XLA's own `cost_analysis()` counts a while loop's body once (a scanned layer stack, a microbatch
loop), so its totals are one iteration short of the program; this module walks the call graph
and multiplies each computation by how often it runs: a while body by its trip count (read off
the loop condition's `compare(i, N)`, less the counter's start value), a fusion or call by its
caller's count.

    ops          per top-level instruction of a scheduled computation (entry, loop bodies, calls):
                 its FLOPs (every dot and convolution inside, fusions included; megablox's
                 grouped matmuls from their operands, grouped_matmul_cost) and the bytes of its
                 operands and result, the HBM traffic of that kernel
    collectives  all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute (their
                 -start forms too; -done carries no data): the full buffer's bytes, the replica
                 groups (device positions in the program's device assignment) and whether XLA
                 issued it asynchronously (an async start, or inside an async collective fusion)
    host         bytes copied between HBM and host memory (memory space 5), both directions
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Bytes per element of HLO's primitive types.
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
                "token": 0}
HOST_MEMORY_SPACE = 5  # XLA's memory space for pinned host memory in a layout: `S(5)`
# Memory spaces other than 0 and the host's are on the chip (`S(1)`: the TPU's vector memory,
# where XLA's memory-space assignment prefetches operands; `S(2)`, `S(6)`: scalars, semaphores):
# reading or writing them is no HBM traffic. The copy or slice that fills them is.
HBM_MEMORY_SPACE = 0

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
               "ragged-all-to-all")
# Ops that move no data of their own (views, bookkeeping, control flow whose bodies are counted).
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain",
         "copy-done", "slice-done", "recv-done", "send-done", "async-update", "async-done"} | {f"{c}-done" for c in COLLECTIVES}
# (an async-update or -done of an async computation moves nothing its start has not: the start is
# charged its operands and result once)

# megablox's grouped matmuls (Pallas calls named by their jit: `.../jit(gmm)/pallas_call`, and
# `jit(tgmm)` for the weights' gradient): opaque to the HLO, their FLOPs come from their operands.
_GROUPED_MATMUL = re.compile(r'op_name="[^"]*jit\((t?gmm)\)/pallas_call')

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEES = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# A computation's closing brace; one the host runs (an offloaded copy, called by a HostExecute
# custom-call) is closed with `}, execution_thread="host"`.
_END = re.compile(r'^\}(\s*,\s*execution_thread="[\w-]*")?\s*$')


@dataclass(frozen=True)
class Shape:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int = 0

    @property
    def bytes(self) -> float:
        return math.prod(self.dims) * _DTYPE_BYTES.get(self.dtype, 4)


def parse_shapes(text: str) -> list[Shape]:
    """Every array shape in an HLO type (a tuple gives several), with its memory space."""
    shapes = []
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        shapes.append(Shape(dtype, tuple(int(d) for d in dims.split(",") if d), int(space[1]) if space else 0))
    return shapes


def _split_type(rest: str) -> tuple[str, str]:
    """('type', 'opcode(...)...') from the text after `name = `: the type may be a tuple."""
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):
            depth += (char == "(") - (char == ")")
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    type_text, _, tail = rest.partition(" ")
    return type_text, tail


@dataclass
class Instruction:
    name: str
    shapes: list[Shape]
    opcode: str
    operands: list[str]
    attributes: str
    literal: str = ""  # a constant's value as written

    @property
    def bytes(self) -> float:
        return sum(s.bytes for s in self.shapes)


@dataclass
class Computation:
    name: str
    params: dict[str, list[Shape]]
    instructions: list[Instruction] = field(default_factory=list)
    _by_name: dict | None = field(default=None, repr=False)

    def shape_of(self, name: str) -> list[Shape]:
        if self._by_name is None or len(self._by_name) != len(self.instructions):
            self._by_name = {instruction.name: instruction for instruction in self.instructions}
        if name in self._by_name:
            return self._by_name[name].shapes
        return self.params.get(name, [])


def _operands(call: str) -> tuple[str, str]:
    """(operand list text, attribute text) of `opcode(a, b), attr=...`."""
    depth = 0
    for i, char in enumerate(call):
        depth += (char == "(") - (char == ")")
        if depth == 0 and char == ")":
            return call[:i], call[i + 1:]
    return call, ""


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """(computations by name, the entry's name) of an HLO module's text."""
    computations: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                params = {}
                for part in re.finditer(r"([\w.\-]+):\s*(\([^)]*\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?)", header[3]):
                    params[part[1]] = parse_shapes(part[2])
                current = Computation(header[2], params)
                if header[1]:
                    entry = current.name
            continue
        if _END.match(line):
            computations[current.name] = current
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        type_text, call = _split_type(match[3])
        opcode, _, args = call.partition("(")
        operand_text, attributes = _operands("(" + args)
        operands = re.findall(r"%([\w.\-]+)", operand_text)
        opcode = opcode.strip()
        current.instructions.append(Instruction(match[2], parse_shapes(type_text), opcode, operands, attributes,
                                                operand_text[1:] if opcode == "constant" else ""))
    return computations, entry


def _callees(instruction: Instruction) -> list[tuple[str, str]]:
    found = _CALLEES.findall(instruction.attributes)
    for group in _BRANCHES.findall(instruction.attributes):
        found += [("branch", name.strip().lstrip("%")) for name in group.split(",") if name.strip()]
    return found


# ---------------------------------------------------------------- FLOPs of one instruction

def _dims(attributes: str, key: str) -> list[int]:
    match = re.search(key + r"=\{([0-9,]*)\}", attributes)
    return [int(d) for d in match[1].split(",") if d] if match else []


def instruction_flops(instruction: Instruction, computation: Computation) -> float:
    """2 x multiply-adds of a dot or convolution; 0 for anything else."""
    if instruction.opcode == "dot" and instruction.shapes:
        lhs = computation.shape_of(instruction.operands[0])
        if not lhs:
            return 0.0
        contracted = math.prod(lhs[0].dims[d] for d in _dims(instruction.attributes, "lhs_contracting_dims"))
        return 2.0 * math.prod(instruction.shapes[0].dims) * contracted
    if instruction.opcode == "convolution" and instruction.shapes and len(instruction.operands) > 1:
        return _convolution_flops(instruction, computation)
    return 0.0


def grouped_matmul_cost(instruction: Instruction, computation: Computation, rows: float) -> tuple[float, float] | None:
    """(FLOPs, HBM bytes) of one of megablox's grouped-matmul kernels, None for any other op.
    `gmm`: rows [m, k] times the groups' weights into [m, n]; `tgmm`: rows [m, k] and gradients
    [m, n] into each local group's [k, n]. Of its row buffer the kernel visits the row tiles that
    hold assignments (the fraction `rows`), and a tile once more for each group that starts inside
    it (megablox.visited_tiles), each visit a whole tile of 2·tm·k·n FLOPs. Bytes are the kernel's
    own estimate (its cost_estimate, for every row tile and boundary of all groups), taken down
    to the tiles visited: `gmm` fetches the group's [k, n] weights again for each row tile it
    visits, and both read their row operands once per tile of the other width."""
    from mxc.compiler.lower.megablox import visited_tiles

    kind = _GROUPED_MATMUL.search(instruction.attributes)
    if kind is None or instruction.opcode != "custom-call" or len(instruction.operands) < 2 or not instruction.shapes:
        return None
    lhs, rhs = (computation.shape_of(o) for o in instruction.operands[-2:])
    out = instruction.shapes[0]
    if not lhs or not rhs or len(lhs[0].dims) != 2:
        return None
    m, k = lhs[0].dims
    gmm = kind[1] == "gmm"
    n = out.dims[-1] if gmm else rhs[0].dims[-1]
    groups = (rhs[0] if gmm else out).dims[0]  # the groups this device holds
    weights = rhs[0].bytes / groups if gmm else 0.0  # one group's [k, n], fetched per row tile
    fixed = 0.0 if gmm else out.bytes  # tgmm writes each group's gradient once
    metadata = _group_metadata(instruction, computation)
    estimate = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', instruction.attributes)
    if metadata is None or estimate is None:  # no grid to read: the rows' work, the weights once
        moved = rows * (lhs[0].bytes + (out.bytes if gmm else rhs[0].bytes)) + (rhs[0].bytes if gmm else out.bytes)
        return 2.0 * rows * m * k * n, moved
    all_groups, grid_tiles = metadata
    tiles_m = grid_tiles - all_groups + 1
    visits = visited_tiles(tiles_m, groups, rows)
    per_row_tile = (float(estimate[1]) - weights * grid_tiles - fixed) / tiles_m
    return 2.0 * (m / tiles_m) * k * n * visits, per_row_tile * visits + weights * visits + fixed


def _group_metadata(instruction: Instruction, computation: Computation) -> tuple[int, int] | None:
    """(groups in all, row tiles plus boundaries the grid is sized for) from a megablox call's
    scalar-prefetch operands: the group offsets s32[groups + 1] and the group and row-tile ids,
    s32[tiles_m + groups - 1] each."""
    sizes = []
    for operand in instruction.operands[:-2]:
        shape = computation.shape_of(operand)
        if shape and shape[0].dtype == "s32" and len(shape[0].dims) == 1:
            sizes.append(shape[0].dims[0])
    if len(sizes) < 3 or sizes[1] != sizes[2]:
        return None
    return sizes[0] - 1, sizes[1]


def _convolution_flops(instruction: Instruction, computation: Computation) -> float:
    """As XLA counts a convolution: per output element, the kernel taps that land inside the
    (unpadded) input, times the input features. TPU programs write most matmuls this way, with
    batch dimensions as fully padded windows."""
    lhs, kernel = (computation.shape_of(o) for o in instruction.operands[:2])
    labels = re.search(r"dim_labels=([^_]+)_([^-]+)->(\S+?)[,\s]", instruction.attributes + " ")
    if not lhs or not kernel or not labels:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels[1], labels[2], labels[3]
    out = instruction.shapes[0].dims
    spatial = sorted(label for label in rhs_labels if label.isdigit())
    window = re.search(r"window=\{([^}]*)\}", instruction.attributes)
    fields = dict(re.findall(r"(\w+)=(\S+)", window[1])) if window else {}
    pads = [tuple(int(v) for v in p.split("_")) for p in fields.get("pad", "").split("x") if p]
    strides = [int(v) for v in fields.get("stride", "").split("x") if v]
    lhs_dilations = [int(v) for v in fields.get("lhs_dilate", "").split("x") if v]
    rhs_dilations = [int(v) for v in fields.get("rhs_dilate", "").split("x") if v]
    taps = 1
    for i, label in enumerate(spatial):
        size_in = lhs[0].dims[lhs_labels.index(label)]
        size_k = kernel[0].dims[rhs_labels.index(label)]
        size_out = out[out_labels.index(label)]
        low = pads[i][0] if i < len(pads) else 0
        stride = strides[i] if i < len(strides) else 1
        taps *= _valid_taps(size_in, size_k, size_out, low, stride,
                            lhs_dilations[i] if i < len(lhs_dilations) else 1,
                            rhs_dilations[i] if i < len(rhs_dilations) else 1)
    outer = math.prod(out) // max(1, math.prod(out[out_labels.index(label)] for label in spatial))
    features = kernel[0].dims[rhs_labels.index("i")]
    return 2.0 * outer * features * taps


def _valid_taps(size_in: int, size_k: int, size_out: int, low: int, stride: int, lhs_dilate: int,
                rhs_dilate: int) -> int:
    """(output, kernel tap) pairs of one spatial dimension whose input position lands on an input
    element: inside the padded-away edges and, with the input dilated, not in a hole between its
    elements (TPU programs write a matmul batched over experts as a convolution whose input is
    dilated by the batch size: counting the holes overstated Mixtral's expert matmuls by 9/8)."""
    if lhs_dilate == 1:  # outputs o with 0 <= o*stride + k*rhs_dilate - low < size_in, per tap k
        valid = 0
        for k in range(size_k):
            shift = k * rhs_dilate - low
            first = max(0, -(shift // stride))
            last = min(size_out - 1, (size_in - 1 - shift) // stride)
            valid += max(0, last - first + 1)
        return valid
    span = (size_in - 1) * lhs_dilate
    return sum(1 for o in range(size_out) for k in range(size_k)
               if 0 <= (p := o * stride + k * rhs_dilate - low) <= span and p % lhs_dilate == 0)


# ---------------------------------------------------------------- replica groups

def replica_groups(attributes: str, devices: int) -> list[list[int]]:
    """The device groups of a collective: `{{0,1},{2,3}}`, the iota form `[G,N]<=[d..]T(perm)`,
    or none written (every device in one group). A collective-permute's pairs become groups."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs[1] + "}")]
    over_mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if over_mesh:
        return _mesh_groups(over_mesh[1], over_mesh[2])
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attributes)
    if iota:
        shape = [int(d) for d in iota[1].split(",")]
        reshape = [int(d) for d in iota[2].split(",")]
        ids = list(range(math.prod(reshape)))
        if iota[3]:
            perm = [int(d) for d in iota[3].split(",")]
            ids = _transpose(ids, reshape, perm)
        size = shape[-1]
        return [ids[i:i + size] for i in range(0, len(ids), size)]
    explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attributes)
    if explicit and explicit[1]:
        return [[int(d) for d in group.split(",") if d] for group in re.findall(r"\{([0-9,]*)\}", explicit[1])]
    return [list(range(devices))]


def _mesh_groups(axes_text: str, grouped_text: str) -> list[list[int]]:
    """Groups written over the device mesh, `mesh['axis_0'=64,'axis_1'=4] {'axis_1'}`: devices
    numbered row-major over the axes; a group varies the named axes, the others fixed."""
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", axes_text)]
    grouped = set(re.findall(r"'([^']+)'", grouped_text))
    names = [name for name, _ in axes]
    sizes = [size for _, size in axes]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    inner = [i for i, name in enumerate(names) if name in grouped]
    outer = [i for i, name in enumerate(names) if name not in grouped]

    def positions(dims: list[int]) -> list[int]:
        out = [0]
        for i in dims:
            out = [base + k * strides[i] for base in out for k in range(sizes[i])]
        return out

    return [[base + offset for offset in positions(inner)] for base in positions(outer)]


def _transpose(ids: list[int], shape: list[int], perm: list[int]) -> list[int]:
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    out_shape = [shape[p] for p in perm]
    out = []
    for flat in range(len(ids)):
        index, rest = [], flat
        for size in reversed(out_shape):
            index.append(rest % size)
            rest //= size
        index.reverse()
        source = sum(index[k] * strides[perm[k]] for k in range(len(perm)))
        out.append(ids[source])
    return out


# ---------------------------------------------------------------- the program

@dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVES
    bytes: float  # the full buffer: an all-gather's output, a reduce-scatter's input, ...
    groups: tuple[tuple[int, ...], ...]
    asynchronous: bool
    count: int  # how often it runs in one step

    @property
    def group_size(self) -> int:
        return max(len(g) for g in self.groups) if self.groups else 1


@dataclass
class ProgramCost:
    """One step of a compiled program, every loop iteration counted."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    host_bytes: float = 0.0
    # (flops, bytes, count) of each top-level op, for a roofline per kernel
    ops: list[tuple[float, float, int]] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    loops: dict[str, int] = field(default_factory=dict)  # while body -> trip count


def trip_count(loop: Instruction, computations: dict[str, Computation], caller: Computation) -> int:
    """A while loop's iterations: its condition compares the counter with a constant (`i < N`);
    the counter starts at its init tuple element when that is a constant, else 0, and steps by what
    the body adds to it. The counter is the tuple element the condition reads: element 0 in the
    loops jax writes, element 4 in XLA's windowed-einsum loops (an FSDP gather fused with its
    matmul), which count by 2."""
    condition = computations.get(dict(_CALLEES.findall(loop.attributes)).get("condition", ""))
    if condition is None:
        return 1
    bound, index = None, 0
    for instruction in condition.instructions:
        if instruction.opcode == "compare" and "direction=LT" in instruction.attributes:
            for operand in instruction.operands:
                value = _literal(condition, operand)
                if value is not None:
                    bound = value
                else:
                    index = _element_read(condition, operand)
            if bound is not None:
                break
    if bound is None:
        return 1
    start = 0
    init = next((i for i in caller.instructions if i.name == (loop.operands or [""])[0]), None)
    if init is not None and init.opcode == "tuple" and len(init.operands) > index:
        start = _literal(caller, init.operands[index]) or 0
    return max(-(-(bound - start) // _counter_step(loop, computations, index)), 1)


def _element_read(computation: Computation, name: str) -> int:
    """The tuple element `name` reads (a get-tuple-element of the loop's state); 0 otherwise."""
    instruction = next((i for i in computation.instructions if i.name == name), None)
    if instruction is not None and instruction.opcode == "get-tuple-element":
        found = re.search(r"index=(\d+)", instruction.attributes)
        if found:
            return int(found.group(1))
    return 0


def _counter_step(loop: Instruction, computations: dict[str, Computation], index: int = 0) -> int:
    """How much the body adds to the counter (tuple element `index`) each iteration: more than 1
    where XLA unrolled the loop."""
    body = computations.get(dict(_CALLEES.findall(loop.attributes)).get("body", ""))
    if body is None or not body.instructions:
        return 1
    root = body.instructions[-1]
    if root.opcode != "tuple" or len(root.operands) <= index:
        return 1
    counter = next((i for i in body.instructions if i.name == root.operands[index]), None)
    if counter is None or counter.opcode != "add":
        return 1
    steps = [_literal(body, operand) for operand in counter.operands]
    return next((step for step in steps if step and step > 0), 1)


def _literal(computation: Computation, name: str) -> int | None:
    """The integer a scalar `constant(N)` instruction holds."""
    for instruction in computation.instructions:
        if instruction.name == name and instruction.opcode == "constant":
            scalar = not instruction.shapes or not instruction.shapes[0].dims
            return int(instruction.literal) if scalar and re.fullmatch(r"-?\d+", instruction.literal) else None
    return None


def program_cost(text: str, devices: int, grouped_rows: float = 1.0) -> ProgramCost:
    """The cost of one run of the HLO module `text` on each of its `devices`. `grouped_rows`: the
    fraction of a grouped-matmul kernel's row buffer that holds assignments (grouped_matmul_cost)."""
    computations, entry = parse_module(text)
    cost = ProgramCost()
    fused_flops: dict[str, float] = {}

    def flops_inside(name: str) -> float:
        """FLOPs of a called computation (a fusion's body), nested calls included."""
        if name not in fused_flops:
            fused_flops[name] = 0.0
            computation = computations.get(name)
            if computation is not None:
                total = 0.0
                for instruction in computation.instructions:
                    total += instruction_flops(instruction, computation)
                    for _, callee in _callees(instruction):
                        total += flops_inside(callee)
                fused_flops[name] = total
        return fused_flops[name]

    def collectives_inside(name: str, asynchronous: bool, count: int, seen: set) -> None:
        computation = computations.get(name)
        if computation is None or name in seen:
            return
        seen = seen | {name}
        for instruction in computation.instructions:
            _record_collective(cost, instruction, computation, asynchronous, count, devices)
            for _, callee in _callees(instruction):
                collectives_inside(callee, asynchronous, count, seen)

    def walk(name: str, count: int, seen: tuple) -> None:
        computation = computations.get(name)
        if computation is None or name in seen:
            return
        seen = seen + (name,)
        for instruction in computation.instructions:
            opcode = instruction.opcode
            callees = _callees(instruction)
            if opcode == "while":
                trips = trip_count(instruction, computations, computation)
                body = dict(callees).get("body")
                if body:
                    cost.loops[body] = trips
                    walk(body, count * trips, seen)
                continue
            if opcode in ("call", "conditional"):
                for _, callee in callees:
                    walk(callee, count, seen)
                continue
            asynchronous = opcode.endswith("-start") or (
                opcode == "custom-call" and "AsyncCollectiveStart" in instruction.attributes)
            _record_collective(cost, instruction, computation, asynchronous, count, devices)
            for role, callee in callees:
                if role == "calls":
                    collectives_inside(callee, asynchronous or _async_fusion(instruction) or "async" in callee,
                                       count, set())
            if opcode in _FREE:
                continue
            grouped = grouped_matmul_cost(instruction, computation, grouped_rows)
            if grouped is not None:
                cost.flops += count * grouped[0]
                cost.hbm_bytes += count * grouped[1]
                cost.ops.append((grouped[0], grouped[1], count))
                continue
            flops = instruction_flops(instruction, computation) + sum(
                flops_inside(callee) for role, callee in callees if role == "calls")
            operand_shapes = [s for o in instruction.operands for s in computation.shape_of(o)]
            on_device = [s.bytes for s in operand_shapes + instruction.shapes if s.memory_space != HOST_MEMORY_SPACE]
            in_place = _untouched_bytes(instruction, computation, computations)
            touches_host = any(s.memory_space == HOST_MEMORY_SPACE for s in operand_shapes + instruction.shapes)
            # A copy between HBM and host moves its device-side array over the host link once, at
            # its start (a slice written into, or read from, a stacked host buffer moves the
            # slice, not the buffer; an async start and its done name the array twice).
            host = max(on_device, default=0.0) if touches_host and not opcode.endswith("-done") else 0.0
            in_hbm = [s.bytes for s in operand_shapes + instruction.shapes if s.memory_space == HBM_MEMORY_SPACE]
            moved = max(0.0, sum(in_hbm) - host - in_place)
            if touches_host:
                moved = max(0.0, sum(on_device) - host - in_place)
            elif opcode in ("copy-start", "slice-start", "collective-permute-start"):
                moved = _transfer_bytes(instruction, operand_shapes)
            elif opcode == "custom-call" and 'custom_call_target="AllocateBuffer"' in instruction.attributes:
                moved = 0.0  # a buffer set aside, nothing written
            cost.flops += count * flops
            cost.hbm_bytes += count * moved
            cost.host_bytes += count * host
            cost.ops.append((flops, moved, count))

    walk(entry, 1, ())
    return cost


def _transfer_bytes(instruction: Instruction, operand_shapes: list[Shape]) -> float:
    """HBM bytes of an asynchronous copy, slice or collective-permute: the array it moves, once
    for each end in HBM (a prefetch into vector memory reads it, an eviction writes it, a copy
    within HBM does both; a permute reads what it sends and writes what it receives). Its result
    names the source again: `copy-start` is (destination, source, context), `slice-start`
    ((source), slice, context), `collective-permute-start` (source, destination, contexts)."""
    data = [s for s in instruction.shapes if s.dims]
    if not data or not operand_shapes:
        return 0.0
    if instruction.opcode == "copy-start":
        destination = data[0]
    elif instruction.opcode == "collective-permute-start":
        destination = data[1] if len(data) > 1 else data[0]
    else:
        destination = data[-1]
    ends = (operand_shapes[0].memory_space == HBM_MEMORY_SPACE) + (destination.memory_space == HBM_MEMORY_SPACE)
    return ends * destination.bytes


_RESHAPED = ("pad", "bitcast")  # an operand these pass on unchanged in dtype, to be sliced after


def _sliced_reads(fused: Computation, param: str, computations: dict[str, Computation],
                  extent: tuple[int, ...] | None = None) -> float | None:
    """Bytes a fusion reads of its parameter `param` when every use is a dynamic-slice of it,
    directly or inside a nested fusion; None when some use reads it otherwise. `extent`: where
    `param` is a padded array, the dimensions of the array before the padding."""
    users = [u for u in fused.instructions if param in u.operands]
    if not users:
        return None
    read = 0.0
    for user in users:
        if user.opcode == "dynamic-slice" and user.operands[0] == param:
            read += _slice_bytes(user, extent)
            continue
        if user.opcode in _RESHAPED and user.operands[0] == param:
            # padded or reinterpreted, then sliced: the slices read what they cover (XLA's
            # windowed einsums pad an operand and slice a window of it each iteration); of a
            # padded array no more than the data holds, the padding is no read
            source = fused.shape_of(param)
            padded = source[0].dims if user.opcode == "pad" and len(source) == 1 else None
            reshaped = _sliced_reads(fused, user.name, computations, padded)
            if reshaped is None:
                return None
            read += reshaped
            continue
        inner = computations.get(dict(_CALLEES.findall(user.attributes)).get("calls", "")) \
            if user.opcode == "fusion" else None
        if inner is None or not inner.instructions:
            return None
        inner_reads = [_sliced_reads(inner, list(inner.params)[i], computations)
                       for i, o in enumerate(user.operands[:len(inner.params)]) if o == param]
        if not inner_reads or any(r is None for r in inner_reads):
            return None
        read += sum(inner_reads)
    return read


def _slice_bytes(slice_: Instruction, extent: tuple[int, ...] | None) -> float:
    """Bytes a dynamic-slice reads: its result, or of a padded array only what lies in the data
    (in each dimension at most the data's extent: a window that half overlaps the padding reads
    half of it)."""
    if extent is None or not slice_.shapes or len(extent) != len(slice_.shapes[0].dims):
        return slice_.bytes
    shape = slice_.shapes[0]
    return math.prod(min(s, e) for s, e in zip(shape.dims, extent)) * _DTYPE_BYTES.get(shape.dtype, 4)


def _untouched_bytes(instruction: Instruction, computation: Computation, computations: dict[str, Computation]) -> float:
    """Bytes of operands and results a kernel names but does not move: a dynamic-update-slice
    writes its update into the buffer in place, a dynamic-slice reads only its slice (alone or
    inside a fusion: a stacked layer buffer of a scan is touched one layer at a time)."""
    def size(name: str, where: Computation) -> float:
        return sum(s.bytes for s in where.shape_of(name) if s.memory_space == HBM_MEMORY_SPACE)

    opcode = instruction.opcode
    if opcode in ("ragged-all-to-all", "ragged-all-to-all-start") and len(instruction.operands) > 1:
        # It reads the rows it sends and writes the rows it receives into its output buffer in
        # place; with balanced routing as many each way: the smaller of its input and output.
        named = sum(size(o, computation) for o in instruction.operands) + sum(
            s.bytes for s in instruction.shapes if s.memory_space != HOST_MEMORY_SPACE)
        rows = min(size(instruction.operands[0], computation), size(instruction.operands[1], computation))
        return max(0.0, named - 2 * rows)
    if opcode in ("dynamic-update-slice", "dynamic-update-slice-start") and len(instruction.operands) > 1:
        # buffer in and out, less the update written
        return max(0.0, 2 * size(instruction.operands[0], computation) - size(instruction.operands[1], computation))
    if opcode in ("dynamic-slice", "dynamic-slice-start") and instruction.operands:
        return max(0.0, size(instruction.operands[0], computation) - instruction.bytes)
    if opcode != "fusion":
        return 0.0
    fused = computations.get(dict(_CALLEES.findall(instruction.attributes)).get("calls", ""))
    if fused is None or not fused.instructions:
        return 0.0
    untouched = 0.0
    params = list(fused.params)
    for index, operand in enumerate(instruction.operands[:len(params)]):
        users = [u for u in fused.instructions if params[index] in u.operands]
        sliced = _sliced_reads(fused, params[index], computations)
        if sliced is not None:  # a stacked layer buffer read one layer at a time, maybe in a nested fusion
            untouched += max(0.0, size(operand, computation) - sliced)
        elif users and all(u.opcode == "dynamic-update-slice" and u.operands[0] == params[index] for u in users):
            untouched += size(operand, computation)  # read in place, never whole
    root = fused.instructions[-1]
    outputs = [next((i for i in fused.instructions if i.name == o), None) for o in root.operands] \
        if root.opcode == "tuple" else [root]
    for output in outputs:
        if output is not None and output.opcode == "dynamic-update-slice" and len(output.operands) > 1:
            untouched += max(0.0, output.bytes - size(output.operands[1], fused))  # only the update is written
    return max(0.0, untouched)


def _async_fusion(instruction: Instruction) -> bool:
    return "async" in instruction.name or "AsyncCollective" in instruction.attributes


def _record_collective(cost: ProgramCost, instruction: Instruction, computation: Computation, asynchronous: bool,
                       count: int, devices: int) -> None:
    opcode = instruction.opcode
    kind = opcode.removesuffix("-start")
    if kind not in COLLECTIVES:
        return
    operand_bytes = sum(s.bytes for o in instruction.operands for s in computation.shape_of(o))
    result_bytes = instruction.shapes[0].bytes if opcode.endswith("-start") and instruction.shapes else instruction.bytes
    if opcode.endswith("-start") and kind != "collective-permute" and len(instruction.shapes) > 1:
        result_bytes = instruction.shapes[-1].bytes if kind == "all-gather" else result_bytes
    # The full buffer: what an all-gather produces, what the others consume.
    size = max(result_bytes, operand_bytes) if kind == "all-gather" else operand_bytes or result_bytes
    groups = tuple(tuple(g) for g in replica_groups(instruction.attributes, devices))
    cost.collectives.append(Collective(kind, float(size), groups, asynchronous or opcode.endswith("-start"), count))
