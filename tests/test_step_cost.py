"""The step-time model from compiled programs: the HLO reader (FLOPs, loops, collectives with
their replica groups) against XLA's own cost analysis and programs whose collectives are known,
the time model's terms by hand, and the fit on rows made with known constants (the published
rows' fit: tests/test_calibration.py)."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import functools

import pytest

from mxc.compiler.plan import hlo_cost
from mxc.compiler.plan.calibration import Constants, fit
from mxc.compiler.plan.cost import ProgramTerms, bubble_fraction, program_step_time


def test_replica_groups_in_every_form():
    assert hlo_cost.replica_groups("replica_groups={{0,1},{2,3}}, x=1", 4) == [[0, 1], [2, 3]]
    assert hlo_cost.replica_groups("replica_groups=[4,2]<=[8], use_global_device_ids=true", 8) == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    # iota 0..7 as [4,2], transposed: element [i][j] is 2j + i
    assert hlo_cost.replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={2}", 8) == [
        [0, 2, 4, 6], [1, 3, 5, 7]]
    assert hlo_cost.replica_groups("replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]
    # over the device mesh: devices row-major over the axes, a group varies the named ones
    assert hlo_cost.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=3] {'axis_0'}, x", 6) == [
        [0, 3], [1, 4], [2, 5]]
    assert hlo_cost.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=3] {'axis_1'}, x", 6) == [
        [0, 1, 2], [3, 4, 5]]
    assert hlo_cost.replica_groups("source_target_pairs={{0,1},{1,0}}, x", 2) == [[0, 1], [1, 0]]


def test_bubble_fraction_of_a_pipeline():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_step_time_terms_by_hand():
    # Two kernels: one compute-bound (1e12 FLOPs, 1e9 bytes), one memory-bound (0 FLOPs, 2e9 bytes);
    # 0.5 s of synchronous and 3 s of asynchronous collectives at full link bandwidth.
    terms = ProgramTerms(ops=((1e12, 1e9, 2), (0.0, 2e9, 1)), exposed_collectives_s=0.5, async_collectives_s=3.0,
                         host_s=0.0, by_kind={"all-reduce": 0.5, "all-gather": 3.0}, peak_flops=1e12,
                         hbm_bandwidth=1e9, model_flops=1e12, tokens=1000, devices=4)
    c = Constants(matmul=0.5, hbm=0.5, link=0.5, overlap=0.8)
    time = program_step_time(terms, c)
    assert time.compute_s == pytest.approx(2 * 1e12 / 0.5e12)  # 4 s
    assert time.memory_s == pytest.approx(2e9 / 0.5e9)  # 4 s
    # exposed: 0.5 / 0.5 = 1 s synchronous; 6 s asynchronous less 0.8 x 8 s busy: hidden entirely
    assert time.exposed_communication_s == pytest.approx(1.0)
    assert time.step_s == pytest.approx(9.0)
    assert time.mfu == pytest.approx(1 / 9)
    assert time.tokens_per_s_per_device == pytest.approx(1000 / 9)
    assert time.source == "compiled program"
    pipelined = program_step_time(ProgramTerms(**{**terms.__dict__, "stages": 2, "microbatches": 3}), c)
    assert pipelined.bubble_fraction == pytest.approx(1 / 4)
    assert pipelined.step_s == pytest.approx(9.0 / (1 - 1 / 4))


@functools.lru_cache(maxsize=None)
def _compiled_on_v5e_8():
    """A scanned program with known collectives, compiled for a v5e-8 slice (libtpu's
    description, no TPU needed): per step, three iterations of x @ w then a psum over the 2
    devices of axis 'a'; after the loop an all-gather over the 4 devices of axis 'b'."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mxc.compiler.topology import devices, parse

    found = devices(parse("v5e-8"))
    mesh = Mesh(np.asarray(found).reshape(2, 4), ("a", "b"))

    def body(x, w):
        def step(carry, _):
            return jax.lax.psum(carry @ w, "a"), None
        out, _ = jax.lax.scan(step, x, None, length=3)
        return jax.lax.all_gather(out, "b", axis=0, tiled=True)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("b", None), P(None, None)), out_specs=P(None, None),
                           check_vma=False)
    x = jax.ShapeDtypeStruct((4 * 256, 512), jnp.float32, sharding=NamedSharding(mesh, P("b", None)))
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=NamedSharding(mesh, P(None, None)))
    compiled = jax.jit(mapped).lower(x, w).compile()
    return compiled, [d for d in mesh.devices.flat]


def test_collectives_and_loops_of_a_compiled_tpu_program():
    compiled, _ = _compiled_on_v5e_8()
    cost = hlo_cost.program_cost(compiled.as_text(), 8)
    # Every matmul counted once per iteration: 3 x (256 x 512 @ 512 x 512) per device.
    assert cost.flops == pytest.approx(3 * 2 * 256 * 512 * 512, rel=0.01)
    # XLA's cost analysis counts the loop body once.
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert xla["flops"] < 0.5 * cost.flops
    reduces = [c for c in cost.collectives if c.kind == "all-reduce"]
    assert sum(c.count for c in reduces) == 3
    assert all(c.group_size == 2 and c.bytes == 256 * 512 * 4 for c in reduces)
    # Groups pair the devices that differ in axis 'a': positions i and i + 4.
    assert sorted(map(sorted, reduces[0].groups)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    gathers = [c for c in cost.collectives if c.kind == "all-gather"]
    assert sum(c.count for c in gathers) == 1
    assert gathers[0].group_size == 4 and gathers[0].bytes == 4 * 256 * 512 * 4


def test_flops_match_xla_cost_analysis_without_loops():
    # With every loop counted once, the reader's FLOPs (dots and convolutions) are XLA's own to
    # within the elementwise work XLA adds.
    compiled, _ = _compiled_on_v5e_8()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    computations, entry = hlo_cost.parse_module(compiled.as_text())
    once = sum(hlo_cost.instruction_flops(i, c) for c in computations.values() for i in c.instructions)
    assert once == pytest.approx(xla["flops"], rel=0.02)


def test_collective_seconds_follow_the_links():
    from mxc.compiler.plan.cost import collective_seconds, device_places
    from mxc.compiler.topology import CHIPS

    compiled, devices = _compiled_on_v5e_8()
    places = device_places(devices)
    chip = CHIPS["v5e"]
    link = chip.ici_bandwidth / chip.ici_links / 2  # one link, one direction
    # The first four devices of a v5e-8 (a 2x4 torus) are a 2x2 square: a ring spans both
    # dimensions, both directions of each.
    assert [c[:2] for _, c in places[:4]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    gather = hlo_cost.Collective("all-gather", 4e6, ((0, 1, 2, 3),), True, 1)
    assert collective_seconds(gather, places, chip) == pytest.approx(3 / 4 * 4e6 / (2 * 2 * link))
    pair = hlo_cost.Collective("all-gather", 4e6, ((0, 1),), True, 1)
    assert collective_seconds(pair, places, chip) == pytest.approx(1 / 2 * 4e6 / (2 * link))
    reduce = hlo_cost.Collective("all-reduce", 4e6, ((0, 1, 2, 3),), False, 1)
    assert collective_seconds(reduce, places, chip) == pytest.approx(2 * collective_seconds(gather, places, chip))


def test_fit_recovers_constants_it_was_made_with():
    # Rows made with known constants: the fit finds constants that reproduce them.
    truth = Constants(matmul=0.55, hbm=0.7, link=0.6, overlap=0.85)
    rows = []
    for scale in (1.0, 3.0, 0.3, 10.0, 0.1):
        terms = ProgramTerms(ops=((1e12, 1e9 * scale, 1), (0.0, 4e8 * scale, 3)), exposed_collectives_s=0.2 * scale,
                             async_collectives_s=1.5 / scale, host_s=0.0, by_kind={}, peak_flops=1e12,
                             hbm_bandwidth=1e9, model_flops=8e11, tokens=1, devices=1)
        published = program_step_time(terms, truth).mfu
        from mxc.compiler.plan.calibration import Row
        from mxc.compiler.plan.cost import program_mfu
        rows.append(Row(f"row {scale}", published, lambda c, t=terms: program_mfu(t, c)))
    fitted = fit(rows)
    for row in rows:  # within the weak pull towards the starting point
        assert row.estimate(fitted) == pytest.approx(row.published_mfu, rel=0.03)
    far = Constants(matmul=0.95, hbm=0.35, link=0.15, overlap=0.1)
    assert sum(abs(r.estimate(far) / r.published_mfu - 1) for r in rows) > 0.5  # the rows can tell


IN_PLACE_UPDATE = """HloModule m
%fused (p0: f32[8,1024], p1: f32[1,1024], p2: s32[]) -> f32[8,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[8,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}

ENTRY %main (a: f32[8,1024], b: f32[1,1024], i: s32[]) -> f32[8,1024] {
  %a = f32[8,1024]{1,0} parameter(0)
  %b = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[8,1024]{1,0} fusion(%a, %b, %i), kind=kLoop, calls=%fused
}
"""


def test_an_update_in_place_moves_the_update_not_the_buffer():
    # One row written into an 8-row buffer: the row read and written, the index; not 2 x 32 KiB.
    cost = hlo_cost.program_cost(IN_PLACE_UPDATE, 1)
    assert cost.hbm_bytes == 2 * 1024 * 4 + 4


@pytest.mark.parametrize("lhs_dilation, stride, rhs_dilation", [(8, 7, 1), (3, 2, 1), (1, 2, 1)])
def test_convolution_flops_skip_the_holes_of_a_dilated_input(lhs_dilation, stride, rhs_dilation):
    # TPU programs write a matmul batched over experts as a convolution whose input is dilated by
    # the batch size (Mixtral's expert einsums); a kernel tap that lands between two input elements
    # multiplies nothing, and XLA's cost analysis does not count it.
    import jax
    import jax.numpy as jnp

    conv = jax.jit(lambda a, b: jax.lax.conv_general_dilated(
        a, b, window_strides=(stride,), padding=[(1, 0)], lhs_dilation=(lhs_dilation,),
        rhs_dilation=(rhs_dilation,), dimension_numbers=("NWC", "WIO", "NWC")))
    compiled = conv.lower(jnp.ones((2, 8, 16)), jnp.ones((8, 16, 32))).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    computations, _ = hlo_cost.parse_module(compiled.as_text())
    ours = sum(hlo_cost.instruction_flops(i, c) for c in computations.values() for i in c.instructions)
    assert ours == xla["flops"]


def test_host_link_follows_the_chips_pcie_generation():
    # v6e connects to its host through PCIe Gen5 (Google's v6e page), the others through Gen4:
    # the offloaded activations of the v6e rows in tests/data/calibration_terms.json are sized so.
    from mxc.compiler.plan.cost import host_bandwidth
    from mxc.compiler.topology import parse

    assert host_bandwidth(parse("v6e-256").chip) == 2 * host_bandwidth(parse("v5p-512").chip) == 64e9


# A layer loop (4 trips) as the TPU compiler writes the dropless experts' kernels: megablox's
# grouped matmul (`gmm`: rows [m, k] x each group's [k, n]) and its weight gradient (`tgmm`), Pallas
# calls whose FLOPs the HLO does not show (each carries the kernel's own estimate over the whole
# row buffer in its backend_config), a ragged all-to-all into a buffer twice its input, and an
# async computation's done. Shapes: Mixtral's experts at a quarter of the rows.
GROUPED_MATMULS = """HloModule grouped

%cond (p: (s32[], bf16[512,128])) -> pred[] {
  %p = (s32[], bf16[512,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], bf16[512,128])) -> (s32[], bf16[512,128]) {
  %q = (s32[], bf16[512,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %rows = bf16[512,128]{1,0} get-tuple-element(%q), index=1
  %tiles = s32[] constant(4)
  %offsets = s32[5]{0} constant({0, 0, 0, 0, 0})
  %first = s32[1]{0} constant({0})
  %w = bf16[4,128,256]{2,1,0} constant({...})
  %gmm.1 = bf16[512,256]{1,0:T(8,128)(2,1)} custom-call(%tiles, %offsets, %first, %rows, %w), custom_call_target="tpu_custom_call", metadata={op_name="jit(flat)/while/body/shard_map/jit(gmm)/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"33554432"}}}
  %tgmm.1 = bf16[4,128,256]{2,1,0:T(8,128)(2,1)} custom-call(%tiles, %offsets, %first, %rows, %gmm.1), custom_call_target="tpu_custom_call", metadata={op_name="jit(flat)/transpose(jvp())/while/body/shard_map/jit(tgmm)/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"33554432"}}}
  %half = bf16[256,128]{1,0} slice(%rows), slice={[0:256], [0:128]}
  %sizes = s64[2]{0} constant({128, 128})
  %sent = bf16[512,128]{1,0} ragged-all-to-all(%half, %rows, %sizes, %sizes, %sizes, %sizes), replica_groups={{0,1}}
  %start = ((bf16[512,128]{1,0}), bf16[512,128]{1,0}, u32[]) async-start(%sent), calls=%copy_async
  %done = bf16[512,128]{1,0} async-done(%start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[512,128]{1,0}) tuple(%next, %done)
}

%copy_async (c: bf16[512,128]) -> bf16[512,128] {
  %c = bf16[512,128]{1,0} parameter(0)
  ROOT %copied = bf16[512,128]{1,0} copy(%c)
}

ENTRY %main (x: bf16[512,128]) -> (s32[], bf16[512,128]) {
  %x = bf16[512,128]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[512,128]{1,0}) tuple(%zero, %x)
  ROOT %loop = (s32[], bf16[512,128]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_grouped_matmul_kernels_count_their_rows_flops():
    # 2 x 512 rows x 128 x 256 per kernel over the whole row buffer: the kernel's own estimate.
    whole = hlo_cost.program_cost(GROUPED_MATMULS, 2)
    assert whole.loops == {"body": 4}
    assert whole.flops == 4 * 2 * (2 * 512 * 128 * 256) == 4 * 2 * 33554432
    # The expert-parallel dispatch's receive buffer at expert 2: half its rows hold assignments.
    half = hlo_cost.program_cost(GROUPED_MATMULS, 2, grouped_rows=0.5)
    assert half.flops == whole.flops / 2
    kernel_bytes = lambda rows: (rows * (512 * 128 + 512 * 256) + 4 * 128 * 256) * 2  # noqa: E731
    copies = 3 * 512 * 128 * 2 + 4  # the async start: its operand, its result tuple (operand, copy, u32)
    ragged = 2 * 256 * 128 * 2  # the rows sent and as many received, not the whole output buffer
    slice_bytes = (512 + 256) * 128 * 2
    counter = 3 * 4  # i + 1
    assert half.hbm_bytes == 4 * (2 * kernel_bytes(0.5) + ragged + copies + slice_bytes + counter)


# megablox's kernels as libtpu compiles them (16 local groups of [1024, 1024], 4096 rows in row
# tiles of 512): the scalar-prefetch operands size the grid (group offsets s32[17], group and row
# tile ids s32[8 + 16 - 1]), and each call carries the kernel's own cost estimate.
TILED_GROUPED_MATMULS = """HloModule tiled

ENTRY %main (rows: bf16[4096,1024], w: bf16[16,1024,1024], g: bf16[4096,1024]) -> (bf16[4096,1024], bf16[16,1024,1024]) {
  %rows = bf16[4096,1024]{1,0} parameter(0)
  %w = bf16[16,1024,1024]{2,1,0} parameter(1)
  %g = bf16[4096,1024]{1,0} parameter(2)
  %tiles = s32[] constant(23)
  %offsets = s32[17]{0} constant({...})
  %group_ids = s32[23]{0} constant({...})
  %tile_ids = s32[23]{0} constant({...})
  %first = s32[1]{0} constant({0})
  %gmm = bf16[4096,1024]{1,0} custom-call(%tiles, %offsets, %group_ids, %tile_ids, %first, %rows, %w), custom_call_target="tpu_custom_call", metadata={op_name="jit(flat)/jvp()/shard_map/jit(gmm)/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"bytes_accessed":"65011712","flops":"8589934592"}}}
  %tgmm = bf16[16,1024,1024]{2,1,0} custom-call(%tiles, %offsets, %group_ids, %tile_ids, %first, %rows, %g), custom_call_target="tpu_custom_call", metadata={op_name="jit(flat)/transpose(jvp())/shard_map/jit(tgmm)/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"bytes_accessed":"50331648","flops":"8589934592"}}}
  ROOT %out = (bf16[4096,1024]{1,0}, bf16[16,1024,1024]{2,1,0}) tuple(%gmm, %tgmm)
}
"""


@pytest.mark.parametrize("rows", [1.0, 0.5])
def test_grouped_matmul_kernels_pay_for_their_tiles(rows):
    """Each group after the first starts inside a row tile, which the grid visits again (a whole
    tile's FLOPs: 15 more visits of 512 rows on 8 tiles' worth), and gmm fetches its group's
    weights for every visit: the kernel's estimate (lhs once per n tile, weights per tile, out
    once) taken down to the tiles visited."""
    computations, entry = hlo_cost.parse_module(TILED_GROUPED_MATMULS)
    main = computations[entry]
    gmm, tgmm = (next(i for i in main.instructions if i.name == name) for name in ("gmm", "tgmm"))
    visits = rows * 8 + 15
    weights, row_tile, gradient = 1024 * 1024 * 2, 512 * 1024 * 2, 16 * 1024 * 1024 * 2
    tile_flops = 2 * 512 * 1024 * 1024
    # gmm: 65011712 = 4096 x 1024 x 2 (rows) + 23 x weights + 4096 x 1024 x 2 (out)
    assert hlo_cost.grouped_matmul_cost(gmm, main, rows) == (visits * tile_flops, visits * (2 * row_tile + weights))
    # tgmm: 50331648 = rows + gradients read once each + every group's weight gradient written once
    assert hlo_cost.grouped_matmul_cost(tgmm, main, rows) == (visits * tile_flops,
                                                               visits * 2 * row_tile + gradient)
