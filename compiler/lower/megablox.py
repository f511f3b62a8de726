"""megablox's grouped matmul, the Pallas TPU kernel shipped with JAX
(jax.experimental.pallas.ops.tpu.megablox), for the dropless experts' dispatch on TPU
(expert_dispatch.py) in place of jax.lax.ragged_dot.

Why: XLA's TPU backend lowers ragged_dot to one dense matmul over every expert, masked (seen in
the compiled HLO with jax 0.10.2 and libtpu 0.0.52: a [experts, rows, out] convolution and a
select), so "dropless" would cost local experts times its FLOPs there; megablox computes each
row with its own expert only. On other platforms the kernel runs in Pallas' interpreter, which is
how the tests check it on CPU. A Pallas kernel is not partitioned by XLA: the dispatch calls it
inside a shard_map manual over every mesh axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


LANE = 128  # TPU lane width: a tile's minor dimension is a multiple of it, or the whole dimension
# The kernel's tiles where the chip is not known: MaxText's defaults (tile_batch_seq 512,
# tile_embed_dim and tile_mlp_dim 1024), which run on TPUs.
ROW_TILE = 512
WIDTH_TILE = 1024
ROW_TILES = (128, 256, 512, 1024, 2048)
WIDTH_TILES = tuple(range(4096, LANE - 1, -LANE))  # 4096, 3968, ..., 128


Tiles = tuple[int, int, int]  # (tm, tk, tn): rows, and the call's k and n widths
CALLS = ("forward", "rows_gradient", "weights_gradient")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A [k, n] product's tiles for its three calls, and the widths both are padded to (a multiple
    of every width tile, so that no call meets a partial tile). The forward is a `gmm` [m, k] x
    [k, n]; the rows' gradient a `gmm` [m, n] x [n, k] (its tk tiles n, its tn tiles k); the
    weights' gradient a `tgmm` of rows [m, k] and gradients [m, n] (tk tiles k, tn tiles n)."""

    forward: Tiles
    rows_gradient: Tiles
    weights_gradient: Tiles
    k: int
    n: int

    def calls(self) -> dict[str, Tiles]:
        return {call: getattr(self, call) for call in CALLS}

    @property
    def rows(self) -> int:  # the calls' common row tile
        return self.forward[0]


def vmem_bytes(kind: str, tiles: Tiles) -> int:
    """VMEM a call takes at tiles (tm, tk, tn) with bfloat16 operands: two buffers of each
    operand's block and of the output's, and a float32 accumulator of the output's block (`gmm`'s
    [tm, tn], `tgmm`'s [tk, tn]). It is what libtpu states when it refuses one, to the byte, for
    most tiles; for some it states up to a fifth more (v6e, 2048 x 1024 x 1024: 33.83 MiB for 28;
    docs/plans.md, "MoE layers")."""
    tm, tk, tn = tiles
    return 4 * (tm * tk + tk * tn + tm * tn) + 4 * (tm * tn if kind == "gmm" else tk * tn)


def visited_tiles(tiles_m: int, groups: int, filled: float = 1.0) -> float:
    """Row tiles the kernel's grid visits when the first `filled` share of its tiles_m row tiles
    holds `groups` groups: each tile once, and once more for each group that starts inside a tile
    (megablox's make_group_metadata). Under routing every group after the first does, but for
    one in a tile's rows."""
    return filled * tiles_m + max(0, groups - 1)


def visit_cost(kind: str, tiles: Tiles, k: int, n: int) -> tuple[float, float]:
    """(MXU FLOPs, HBM bytes) of one row-tile visit of a call on bfloat16 operands [tm, k] x [k, n]
    (the widths as padded), as the kernel's own cost estimate counts the traffic: `gmm` reads the
    group's [k, n] weights, the tile's rows once per n tile and writes its [tm, n] output; `tgmm`
    reads the tile's rows once per n tile and its gradients once per k tile (each group's weight
    gradient is written once, not per visit)."""
    tm, tk, tn = tiles
    n_tiles, k_tiles = -(-n // tn), -(-k // tk)
    moved = (k * n + tm * k * n_tiles + tm * n) if kind == "gmm" else (tm * k * n_tiles + tm * n * k_tiles)
    return 2.0 * tm * k * n, 2.0 * moved


def _kind(call: str) -> str:
    return "tgmm" if call == "weights_gradient" else "gmm"


def call_visit(call: str, tiles: Tiles, k: int, n: int) -> tuple[float, float]:
    """visit_cost of one of a [k, n] product's calls (widths padded), in the call's own terms: the
    rows' gradient multiplies by the transposed weights, [n, k]."""
    return visit_cost(_kind(call), tiles, *((n, k) if call == "rows_gradient" else (k, n)))


@functools.lru_cache(maxsize=None)  # the search prices many plans of few shapes
def tiling(m: int, groups: int, k: int, n: int, flops_per_byte: float = 0.0, vmem: int = 0) -> Tiling:
    """The tiles of m rows [m, k] in `groups` groups times [k, n] weights, on a chip whose MXUs do
    `flops_per_byte` FLOPs per byte its HBM delivers and whose kernels may take `vmem` bytes of
    VMEM (0 for either: not known, MaxText's tiles for all three calls). A visit fetches the
    group's weights again: below about flops_per_byte rows it waits for them; above, the boundary
    visits compute more of other groups' rows. A wider n tile reads the rows fewer times, a wider
    k tile the gradients. So, for the common padding of the widths that takes least time (padding
    each by at most an eighth, or to the lane), each call gets the tiles within the VMEM (less a
    quarter, for what vmem_bytes leaves out) whose visits take least time at the longer of their
    FLOPs and their bytes; of equal times, the fewest grid steps (each has a fixed cost). The calls
    share one row tile, as in jax's ops.gmm: a row tile chosen for the weights' gradient alone
    would be as narrow as the boundary visits favour, in grid steps whose fixed cost is not
    measured here."""
    rows = _round_up(m, LANE)
    quanta = [q for q in WIDTH_TILES
              if all(_round_up(size, q) <= max(_round_up(size, LANE), size + size // 8) for size in (k, n))]
    if not flops_per_byte or not vmem:
        quantum = max(q for q in quanta if q <= WIDTH_TILE)
        tiles = (min(ROW_TILE, rows), quantum, quantum)
        return Tiling(tiles, tiles, tiles, _round_up(k, quantum), _round_up(n, quantum))
    row_tiles = sorted({min(tile, rows) for tile in ROW_TILES})

    def time(call: str, tiles: Tiles, kp: int, np_: int) -> tuple[float, float]:
        tm, tk, tn = tiles
        visits = visited_tiles(-(-m // tm), groups)
        flops, moved = call_visit(call, tiles, kp, np_)
        return visits * max(flops, moved * flops_per_byte), visits * -(-kp // tk) * -(-np_ // tn)

    best = None
    for quantum in quanta:
        kp, np_ = _round_up(k, quantum), _round_up(n, quantum)
        widths = [tile for tile in WIDTH_TILES if quantum % tile == 0]
        for tm in row_tiles:
            chosen = {}
            for call in CALLS:
                fitting = [(tm, tk, tn) for tk in widths for tn in widths
                           if vmem_bytes(_kind(call), (tm, tk, tn)) <= vmem - vmem // 4]
                if not fitting:
                    break
                chosen[call] = min(fitting, key=lambda tiles: time(call, tiles, kp, np_))
            else:
                total = tuple(map(sum, zip(*(time(call, chosen[call], kp, np_) for call in CALLS))))
                if best is None or total < best[0]:
                    best = (total, Tiling(chosen["forward"], chosen["rows_gradient"], chosen["weights_gradient"], kp, np_))
    return best[1]


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def grouped_matmul(rows: jax.Array, kernel: jax.Array, group_sizes: jax.Array, first_group: jax.Array,
                   interpret: bool, every_row_grouped: bool = False, flops_per_byte: float = 0.0,
                   vmem: int = 0) -> jax.Array:
    """rows [m, k] sorted by group, kernel [local groups, k, n] holding groups first_group, ...;
    group_sizes [all groups]. Rows of other groups come back as zeros. `every_row_grouped`: the
    caller's promise that the m rows are exactly the groups' (sum(group_sizes) == m) and the
    kernel holds every group, so that no row needs masking."""
    m, k = rows.shape
    n = kernel.shape[-1]
    # The kernel leaves rows outside the groups unwritten, in its output and in its rows'
    # gradient: masking its input as well as its output keeps them out of both. Each mask is a
    # copy of its [m, k] or [m, n] array (DeepSeek V3 at 6 sequences of 8192 a device: 5.25 GiB
    # for [393216, 7168]), so rows that all belong to a local group go unmasked; the rows padded
    # below are cut off again.
    mask = not (every_row_grouped and kernel.shape[0] == group_sizes.shape[0])
    if mask:
        local = jnp.cumsum(group_sizes)
        start = jnp.where(first_group > 0, local[first_group - 1], 0)
        end = local[first_group + kernel.shape[0] - 1]
        index = jnp.arange(m)
        mine = ((index >= start) & (index < end))[:, None]
        rows = jnp.where(mine, rows, 0)
    # Widths are padded with zeros to a multiple of every tile: the rows' gradient swaps the k
    # and n widths, so a whole-dimension tile of one width fails against the other (a d_model 64,
    # d_ff 96 model did not compile for v5p-8).
    tiles = tiling(m, kernel.shape[0], k, n, flops_per_byte, vmem)
    rows = jnp.pad(rows, ((0, _round_up(m, tiles.rows) - m), (0, tiles.k - k)))
    kernel = jnp.pad(kernel, ((0, 0), (0, tiles.k - k), (0, tiles.n - n)))
    out = _gmm(rows, kernel, group_sizes, first_group.astype(jnp.int32), tiles, interpret)[:m, :n]
    return jnp.where(mine, out, 0) if mask else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gmm(rows, kernel, group_sizes, first_group, tiles: Tiling, interpret: bool):
    """jax's megablox ops.gmm, with each of the three calls at its own tiles (ops.gmm passes one
    tiling to all three)."""
    from jax.experimental.pallas.ops.tpu.megablox.ops import backend

    return backend.gmm(rows, kernel, group_sizes, rows.dtype, tiles.forward, first_group, interpret=interpret)


def _gmm_forward(rows, kernel, group_sizes, first_group, tiles, interpret):
    return _gmm(rows, kernel, group_sizes, first_group, tiles, interpret), (rows, kernel, group_sizes, first_group)


def _gmm_backward(tiles, interpret, residuals, grad):
    from jax.experimental.pallas.ops.tpu.megablox.ops import backend

    rows, kernel, group_sizes, first_group = residuals
    grad_rows = backend.gmm(grad, kernel, group_sizes, rows.dtype, tiles.rows_gradient, first_group,
                            transpose_rhs=True, interpret=interpret)
    grad_kernel = backend.tgmm(rows.swapaxes(0, 1), grad, group_sizes, kernel.dtype, tiles.weights_gradient,
                               first_group, kernel.shape[0], interpret=interpret)
    return grad_rows, grad_kernel, None, None


_gmm.defvjp(_gmm_forward, _gmm_backward)
