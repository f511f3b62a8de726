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

import functools
import math

import jax
import jax.numpy as jnp


LANE = 128  # TPU lane width: a tile's minor dimension is a multiple of it, or the whole dimension
# The kernel's tiles where the chip is not known: MaxText's defaults (tile_batch_seq 512,
# tile_embed_dim and tile_mlp_dim 1024), which run on TPUs.
ROW_TILE = 512
WIDTH_TILE = 1024
ROW_TILES = (128, 256, 512, 1024, 2048)
WIDTH_TILES = tuple(range(4096, LANE - 1, -LANE))  # 4096, 3968, ..., 128


@functools.lru_cache(maxsize=None)  # the search prices many plans of few shapes
def width_tiles(k: int, n: int, widest: int = WIDTH_TILE) -> list[tuple[int, int]]:
    """The kernel's (tk, tn) tiles of a [k, n] product up to `widest`, widest first: those whose
    common multiple pads each width by at most an eighth (or to the lane). Both widths are padded
    to it, since the rows' gradient tiles n by tk and k by tn, and the kernels then never meet a
    partial tile. A narrow tile reads the other operand once per tile: GPT-OSS's 2880, padded to
    the lane (2944 = 23 x 128), would only take 128-wide tiles and read its rows 23 times."""
    tiles = [tile for tile in WIDTH_TILES if tile <= widest]
    pairs = [(tk, tn) for tk in tiles for tn in tiles
             if all(_round_up(size, math.lcm(tk, tn)) <= max(_round_up(size, LANE), size + size // 8) for size in (k, n))]
    return sorted(pairs, key=lambda pair: (-min(pair), -max(pair), -pair[0]))


def padded_width(size: int, tiles: tuple[int, int, int]) -> int:
    """A width as the kernel takes it at tiles (tm, tk, tn): a multiple of both width tiles."""
    return _round_up(size, math.lcm(tiles[1], tiles[2]))


def vmem_bytes(tiles: tuple[int, int, int]) -> int:
    """VMEM the kernels take at tiles (tm, tk, tn) with bfloat16 operands: two buffers of each
    operand's block and of the output's, and a float32 accumulator of the output's block (`gmm`'s
    [tm, tn], `tgmm`'s [tk, tn]). It is what libtpu states when it refuses one, to the byte, for
    most tiles; for some it states up to a fifth more (v6e, 2048 x 1024 x 1024: 33.83 MiB for 28;
    docs/plans.md, "MoE layers")."""
    tm, tk, tn = tiles
    return max(4 * (tm * tk + tk * tn + tm * tn) + 4 * out for out in (tm * tn, tk * tn))


def visited_tiles(tiles_m: int, groups: int, filled: float = 1.0) -> float:
    """Row tiles the kernel's grid visits when the first `filled` share of its tiles_m row tiles
    holds `groups` groups: each tile once, and once more for each group that starts inside a tile
    (megablox's make_group_metadata). Under routing every group after the first does, but for
    one in a tile's rows."""
    return filled * tiles_m + max(0, groups - 1)


def visit_cost(kind: str, tiles: tuple[int, int, int], k: int, n: int) -> tuple[float, float]:
    """(MXU FLOPs, HBM bytes) of one row-tile visit of a call on bfloat16 operands [tm, k] x [k, n]
    (the widths as padded), as the kernel's own cost estimate counts the traffic: `gmm` reads the
    group's [k, n] weights, the tile's rows once per n tile and writes its [tm, n] output; `tgmm`
    reads the tile's rows once per n tile and its gradients once per k tile (each group's weight
    gradient is written once, not per visit)."""
    tm, tk, tn = tiles
    n_tiles, k_tiles = -(-n // tn), -(-k // tk)
    moved = (k * n + tm * k * n_tiles + tm * n) if kind == "gmm" else (tm * k * n_tiles + tm * n * k_tiles)
    return 2.0 * tm * k * n, 2.0 * moved


def kernel_visits(tiles: tuple[int, int, int], k: int, n: int) -> dict[str, tuple[float, float]]:
    """visit_cost of the three calls of a [k, n] product's training step at one tiling (ops.gmm
    passes its tiles to all three): the forward, the rows' gradient (a gmm on the transposed
    weights: [tm, n] x [n, k], n tiled by tk, k by tn) and the weights' gradient (tgmm)."""
    k, n = padded_width(k, tiles), padded_width(n, tiles)
    return {"forward": visit_cost("gmm", tiles, k, n), "rows_gradient": visit_cost("gmm", tiles, n, k),
            "weights_gradient": visit_cost("tgmm", tiles, k, n)}


@functools.lru_cache(maxsize=None)
def tiling(m: int, groups: int, k: int, n: int, flops_per_byte: float = 0.0, vmem: int = 0) -> tuple[int, int, int]:
    """The (tm, tk, tn) tiles of m rows [m, k] in `groups` groups times [k, n] weights, on a chip
    whose MXUs do `flops_per_byte` FLOPs per byte its HBM delivers and whose kernels may take
    `vmem` bytes of VMEM (0: not known, MaxText's tiles). A visit fetches the group's weights
    again: below about flops_per_byte rows it waits for them; above, the boundary visits compute
    more of other groups' rows. A wider n tile reads the rows fewer times, a wider k tile the
    gradients. So the tiles within the VMEM (less a quarter, for what vmem_bytes leaves out) whose
    three calls' visits (kernel_visits, visited_tiles) take least time at the longer of their
    FLOPs and their bytes; of equal times, the fewest grid steps (each has a fixed cost)."""
    rows = _round_up(m, LANE)
    if not flops_per_byte:
        return (min(ROW_TILE, rows), *width_tiles(k, n)[0])
    widest, most_rows = (max(WIDTH_TILES), max(ROW_TILES)) if vmem else (WIDTH_TILE, WIDTH_TILE)

    def time(tiles: tuple[int, int, int]) -> tuple[float, float]:
        tm, tk, tn = tiles
        visits = visited_tiles(-(-m // tm), groups)
        seconds = visits * sum(max(flops, moved * flops_per_byte) for flops, moved in kernel_visits(tiles, k, n).values())
        return seconds, visits * -(-k // tk) * -(-n // tn)

    candidates = [(tm, tk, tn) for tm in sorted({min(tile, rows) for tile in ROW_TILES if tile <= most_rows})
                  for tk, tn in width_tiles(k, n, widest)]
    fitting = [tiles for tiles in candidates if not vmem or vmem_bytes(tiles) <= vmem - vmem // 4]
    return min(fitting or [min(candidates, key=vmem_bytes)], key=time)


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def grouped_matmul(rows: jax.Array, kernel: jax.Array, group_sizes: jax.Array, first_group: jax.Array,
                   interpret: bool, every_row_grouped: bool = False, flops_per_byte: float = 0.0,
                   vmem: int = 0) -> jax.Array:
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
    # Widths are padded with zeros to a multiple of both tiles: the kernel's backward swaps the k
    # and n tiles, so a whole-dimension tile of one width fails against the other (a d_model 64,
    # d_ff 96 model did not compile for v5p-8).
    tiles = tiling(m, kernel.shape[0], k, n, flops_per_byte, vmem)
    padded_k, padded_n, tm = padded_width(k, tiles), padded_width(n, tiles), tiles[0]
    rows = jnp.pad(rows, ((0, _round_up(m, tm) - m), (0, padded_k - k)))
    kernel = jnp.pad(kernel, ((0, 0), (0, padded_k - k), (0, padded_n - n)))
    out = ops.gmm(rows, kernel, group_sizes, rows.dtype, tiles,
                  first_group.astype(jnp.int32), None, False, interpret)[:m, :n]
    return jnp.where(mine, out, 0) if mask else out
