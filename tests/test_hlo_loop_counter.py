"""The HLO reader's trip count for a while loop whose counter is not the state's first element:
XLA's windowed-einsum loops (an FSDP weight gather fused with its matmul, a piece per iteration)
keep the counter at element 4 and add 2 to it per iteration, two matmul pieces in the body. Read
as element 0 (a constant start, no step) the loop ran twice as often as it does, and every
matmul of MaxText's 32B v5p-128 setting read 1.6x its model FLOPs where it runs 1.006x
(docs/plans.md, "Published results outside the fit")."""

from mxc.compiler.plan import hlo_cost

WINDOWED = """HloModule windowed
%cond (c: (bf16[256,128], bf16[128,128], bf16[256,128], s32[], u32[])) -> pred[] {
  %c = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}, s32[], u32[]) parameter(0)
  %bound = u32[] constant(8)
  %i = u32[] get-tuple-element(%c), index=4
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%body (b: (bf16[256,128], bf16[128,128], bf16[256,128], s32[], u32[])) -> (bf16[256,128], bf16[128,128], bf16[256,128], s32[], u32[]) {
  %b = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}, s32[], u32[]) parameter(0)
  %x = bf16[256,128]{1,0} get-tuple-element(%b), index=0
  %w = bf16[128,128]{1,0} get-tuple-element(%b), index=1
  %acc = bf16[256,128]{1,0} get-tuple-element(%b), index=2
  %other = s32[] get-tuple-element(%b), index=3
  %i = u32[] get-tuple-element(%b), index=4
  %d0 = bf16[256,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d1 = bf16[256,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s0 = bf16[256,128]{1,0} add(%acc, %d0)
  %s1 = bf16[256,128]{1,0} add(%s0, %d1)
  %two = u32[] constant(2)
  %next = u32[] add(%i, %two)
  ROOT %t = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}, s32[], u32[]) tuple(%x, %w, %s1, %other, %next)
}

ENTRY %main (x: bf16[256,128], w: bf16[128,128]) -> (bf16[256,128], bf16[128,128], bf16[256,128], s32[], u32[]) {
  %x = bf16[256,128]{1,0} parameter(0)
  %w = bf16[128,128]{1,0} parameter(1)
  %zero = bf16[256,128]{1,0} constant(0)
  %seven = s32[] constant(7)
  %start = u32[] constant(0)
  %init = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}, s32[], u32[]) tuple(%x, %w, %zero, %seven, %start)
  ROOT %loop = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}, s32[], u32[]) while(%init), condition=%cond, body=%body
}
"""


def test_a_windowed_einsum_loop_counts_by_its_own_counter():
    # Counter at element 4, from 0 to 8 by 2: 4 iterations of two 256 x 128 x 128 matmuls.
    # (Element 0 as the counter read 8 iterations: the bound, with no start and no step.)
    cost = hlo_cost.program_cost(WINDOWED, 1)
    assert cost.loops == {"body": 4}
    assert cost.flops == 4 * 2 * (2 * 256 * 128 * 128)
