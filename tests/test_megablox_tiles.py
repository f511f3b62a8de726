"""megablox's row tile by the chip (megablox.row_tile) and what its tiles cost in the formula
(cost._grouped_tile_overhead_per_token): the grid fetches a group's weights once per row tile it
visits, and visits a tile once more for each group that starts inside one."""

from __future__ import annotations

import pytest

from mxc.compiler.lower.choices import LoweringChoices
from mxc.compiler.lower.megablox import ROW_TILE, row_tile, visited_tiles
from mxc.compiler.topology import CHIPS

V5P = CHIPS["v5p"].peak_bf16_flops / CHIPS["v5p"].hbm_bandwidth  # about 166 FLOPs per byte
V6E = CHIPS["v6e"].peak_bf16_flops / CHIPS["v6e"].hbm_bandwidth  # about 560


def test_row_tiles_reach_the_chips_flops_per_byte_and_no_further():
    # DeepSeek V3's experts on fsdp 1024: 6 x 8192 tokens x 8 rows over 256 groups a device, times
    # [7168, 2048]. 128 rows a tile wait for the weights on v5p (3327 visits); 512 compute 255
    # boundary tiles that are mostly other groups' rows; 256 takes the least time.
    assert row_tile(393216, 256, 7168, 2048, V5P) == 256
    # v6e's MXUs do 560 FLOPs per HBM byte: there 1024 rows, the boundaries notwithstanding.
    assert row_tile(393216, 256, 7168, 2048, V6E) == 1024
    # No chip known (a program traced without a plan): MaxText's tile; a tile never outgrows the rows.
    assert row_tile(393216, 256, 7168, 2048) == ROW_TILE == 512
    assert row_tile(300, 4, 1024, 1024) == 384 and row_tile(300, 4, 1024, 1024, V5P) == 128


def test_a_plan_sizes_megablox_for_its_chip():
    assert LoweringChoices.for_chip(CHIPS["v5p"]).grouped_flops_per_byte == pytest.approx(V5P)
    assert LoweringChoices.for_chip(CHIPS["cpu"]).grouped_flops_per_byte == pytest.approx(
        CHIPS["cpu"].peak_bf16_flops / CHIPS["cpu"].hbm_bandwidth)
    assert LoweringChoices.for_platform("tpu").grouped_flops_per_byte == 0.0


def test_the_formula_charges_the_tiles_of_a_dropless_layer(monkeypatch):
    from test_memory_dropless import _choice

    from mxc.compiler.plan import cost
    from mxc.compiler.plan.activations import RECOMPUTED
    from mxc.compiler.plan.calibration import FITTED

    choice = _choice("dropless")  # v5p-8, fsdp 4: 2 x 2048 tokens x 4 rows a device, 64 experts
    moe = choice.spec.blocks[choice.spec.layer_kinds[0]].mlp
    recomputed = RECOMPUTED[choice.remat]
    # 16384 rows: 256-row tiles (127 visits) beat 128 (191 visits, each waiting for its weights
    # at v5p's 166 FLOPs per byte) and 512 (95 visits, most of their rows other groups').
    assert row_tile(16384, 64, 1024, 1024, V5P) == 256 and visited_tiles(64, 64) == 127
    # A gmm visit moves the group's [1024, 1024] weights, its [256, 1024] rows and output: 170.7
    # FLOPs a byte, where v5p at FITTED does 213.6; a tgmm visit reads rows and gradients: 512.
    v5p = CHIPS["v5p"]
    balance = v5p.peak_bf16_flops * FITTED.matmul / (v5p.hbm_bandwidth * FITTED.hbm)
    gmm = balance / (256 * 1024 * 1024 / (1024 * 1024 + 2 * 256 * 1024))
    again = "mlp_in" in recomputed
    runs = 2 * 3 * gmm + again * 2 * gmm + 3  # forward, rows' gradient, inputs recomputed, tgmm
    useful = 9 + again * 2
    extra = cost._grouped_tile_overhead_per_token(moe, 1024, choice, recomputed)
    assert extra == pytest.approx(2 * 1024 * 1024 * 4 * (runs * 127 * 256 / 16384 - useful))
    executed = cost.executed_flops_per_token(choice)[1]
    monkeypatch.setattr(cost, "_grouped_tile_overhead_per_token", lambda *args: 0.0)
    assert executed - cost.executed_flops_per_token(choice)[1] == pytest.approx(2 * extra)  # two MoE layers


def test_width_tiles_are_wide_where_a_little_padding_buys_it():
    from mxc.compiler.lower.megablox import padded_width, visit_cost, width_tile

    # GPT-OSS's 2880: padded to 3072 with 1024-wide tiles (6.7% more), not to the lane's 2944,
    # whose only tile is 128 wide (23 = 2944 / 128 is prime), where the rows are read 23 times.
    assert (width_tile(2880), padded_width(2880)) == (1024, 3072)
    assert (width_tile(1536), width_tile(7168), width_tile(96)) == (768, 1024, 128)
    # A gmm visit of 256 rows of DeepSeek's [7168, 2048]: its weights, its rows twice (two n
    # tiles), its output.
    assert visit_cost("gmm", 256, 7168, 2048) == (2 * 256 * 7168 * 2048,
                                                   2 * (7168 * 2048 + 256 * 7168 * 2 + 256 * 2048))
    assert visit_cost("tgmm", 256, 7168, 2048) == (2 * 256 * 7168 * 2048, 2 * (256 * 7168 * 2 + 256 * 2048 * 7))
