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

import jax
import jax.numpy as jnp


LANE = 128  # TPU lane width: a tile's minor dimension is a multiple of it, or the whole dimension
# The kernel's tiles at most, and its row tile where the chip is not known: MaxText's defaults
# (tile_batch_seq 512, tile_embed_dim and tile_mlp_dim 1024), which run on TPUs.
ROW_TILE = 512
ROW_TILES = (128, 256, 512, 1024)
WIDTH_TILES = tuple(range(1024, LANE - 1, -LANE))  # 1024, 896, ..., 128


def width_tile(size: int) -> int:
    """The kernel's tile of a k or n width: the widest that pads the width by at most an eighth
    (or to the lane). A narrow tile reads the other operand once per tile: GPT-OSS's 2880, padded
    to the lane (2944 = 23 x 128), would take 128-wide tiles and read its rows 23 times."""
    lane = _round_up(size, LANE)
    return next(tile for tile in WIDTH_TILES if _round_up(size, tile) <= max(lane, size + size // 8))


def padded_width(size: int) -> int:
    return _round_up(size, width_tile(size))


def visited_tiles(tiles_m: int, groups: int, filled: float = 1.0) -> float:
    """Row tiles the kernel's grid visits when the first `filled` share of its tiles_m row tiles
    holds `groups` groups: each tile once, and once more for each group that starts inside a tile
    (megablox's make_group_metadata). Under routing every group after the first does, but for
    one in a tile's rows."""
    return filled * tiles_m + max(0, groups - 1)


def visit_cost(kind: str, tm: int, k: int, n: int) -> tuple[float, float]:
    """(MXU FLOPs, HBM bytes) of one row-tile visit of bfloat16 operands [tm, k] x [k, n], the
    widths padded to their tiles and the traffic as the kernel's own cost estimate counts it: `gmm`
    reads the group's [k, n] weights, the tile's rows once per n tile and writes its [tm, n]
    output; `tgmm` reads the tile's rows once per n tile and its gradients once per k tile (each
    group's weight gradient is written once, not per visit)."""
    kp, np_ = padded_width(k), padded_width(n)
    n_tiles, k_tiles = np_ // width_tile(n), kp // width_tile(k)
    moved = (kp * np_ + tm * kp * n_tiles + tm * np_) if kind == "gmm" else (tm * kp * n_tiles + tm * np_ * k_tiles)
    return 2.0 * tm * kp * np_, 2.0 * moved


def row_tile(m: int, groups: int, k: int, n: int, flops_per_byte: float = 0.0) -> int:
    """Rows per tile for m rows [m, k] in `groups` groups times [k, n] weights, on a chip whose
    MXUs do `flops_per_byte` FLOPs per byte its HBM delivers (0: not known, ROW_TILE). A visit
    (visit_cost) fetches the group's weights again: below about flops_per_byte rows it waits for
    them; above, the boundary visits compute more of other groups' rows. So the tile whose visits
    (visited_tiles) take least time at the longer of their FLOPs and their bytes."""
    rows = _round_up(m, LANE)
    if not flops_per_byte:
        return min(ROW_TILE, rows)

    def time(tile: int) -> float:
        flops, moved = visit_cost("gmm", tile, k, n)
        return visited_tiles(-(-m // tile), groups) * max(flops, moved * flops_per_byte)

    return min(sorted({min(tile, rows) for tile in ROW_TILES}), key=time)


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def grouped_matmul(rows: jax.Array, kernel: jax.Array, group_sizes: jax.Array, first_group: jax.Array,
                   interpret: bool, every_row_grouped: bool = False, flops_per_byte: float = 0.0) -> jax.Array:
    """rows [m, k] sorted by group, kernel [local groups, k, n] holding groups first_group, ...;
    group_sizes [all groups]. Rows of other groups come back as zeros. `every_row_grouped`: the
    caller's promise that the m rows are exactly the groups' (sum(group_sizes) == m) and the
    kernel holds every group, so that no row needs masking."""
    from jax.experimental.pallas.ops.tpu.megablox import ops

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
    # Widths are padded with zeros to a multiple of their tile: the kernel's backward swaps the k
    # and n tiles, so a whole-dimension tile of one width fails against the other (a d_model 64,
    # d_ff 96 model did not compile for v5p-8).
    padded_k, padded_n = padded_width(k), padded_width(n)
    tm = row_tile(m, kernel.shape[0], k, n, flops_per_byte)
    rows = jnp.pad(rows, ((0, _round_up(m, tm) - m), (0, padded_k - k)))
    kernel = jnp.pad(kernel, ((0, 0), (0, padded_k - k), (0, padded_n - n)))
    out = ops.gmm(rows, kernel, group_sizes, rows.dtype, (tm, width_tile(k), width_tile(n)),
                  first_group.astype(jnp.int32), None, False, interpret)[:m, :n]
    return jnp.where(mine, out, 0) if mask else out
