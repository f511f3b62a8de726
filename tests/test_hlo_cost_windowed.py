"""The HLO reader's HBM bytes for the kernels of XLA's windowed-einsum loops (a tensor-parallel
matmul split into one piece per iteration, the pieces passed around the ring): each iteration
reads a window of the activation through a padded copy of it, and sends and receives its piece
with a collective-permute. Each is charged the bytes it moves (the forms are those of MaxText's
32B setting on v5p-128, docs/plans.md "Published results outside the fit")."""

from mxc.compiler.plan import hlo_cost

MIB = 2**20

# The activation shard [1024, 1, 4096] padded by one row below and one above, a window of 256
# columns sliced from each and the two merged: each slice covers one row of data and one of
# padding (XLA writes the two directions of a bidirectional loop this way).
TWO_WINDOWS = """HloModule windows
%merge (q0: s32[], q1: bf16[1024,1,4096], q2: s32[]) -> bf16[1024,2,256] {
  %q1 = bf16[1024,1,4096]{2,1,0} parameter(1)
  %ninf = bf16[] constant(-inf)
  %below = bf16[1024,2,4096]{2,1,0} pad(%q1, %ninf), padding=0_0x0_1x0_0
  %z = s32[] constant(0)
  %q0 = s32[] parameter(0)
  %first = bf16[1024,2,256]{2,1,0} dynamic-slice(%below, %z, %z, %q0), dynamic_slice_sizes={1024,2,256}
  %above = bf16[1024,2,4096]{2,1,0} pad(%q1, %ninf), padding=0_0x1_0x0_0
  %q2 = s32[] parameter(2)
  %second = bf16[1024,2,256]{2,1,0} dynamic-slice(%above, %z, %z, %q2), dynamic_slice_sizes={1024,2,256}
  ROOT %both = bf16[1024,2,256]{2,1,0} maximum(%first, %second)
}

ENTRY %main (i: s32[], a: bf16[1024,1,4096], j: s32[]) -> bf16[1024,2,256] {
  %i = s32[] parameter(0)
  %a = bf16[1024,1,4096]{2,1,0} parameter(1)
  %j = s32[] parameter(2)
  ROOT %k = bf16[1024,2,256]{2,1,0} fusion(%i, %a, %j), kind=kLoop, calls=%merge
}
"""


def test_windows_of_a_padded_operand_read_only_its_data():
    # Each window reads its 256 columns of the one data row (512 KiB), not the padding row with
    # them: 1 MiB read for the two, 1 MiB written, the two indices.
    cost = hlo_cost.program_cost(TWO_WINDOWS, 1)
    assert cost.hbm_bytes == 2 * 1024 * 256 * 2 + 1024 * 2 * 256 * 2 + 2 * 4


# A 4 MiB piece passed to the next device, source and destination in HBM; then one read from
# the chip's vector memory (`S(1)`), which only its destination moves through HBM.
PERMUTE = """HloModule permute
ENTRY %main (a: bf16[1024,2048], b: bf16[1024,2048]) -> (bf16[1024,2048], bf16[1024,2048]) {
  %a = bf16[1024,2048]{1,0} parameter(0)
  %s = (bf16[1024,2048]{1,0}, bf16[1024,2048]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %d = bf16[1024,2048]{1,0} collective-permute-done(%s)
  %b = bf16[1024,2048]{1,0} parameter(1)
  %v = bf16[1024,2048]{1,0:S(1)} copy(%b)
  %t = (bf16[1024,2048]{1,0:S(1)}, bf16[1024,2048]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%v), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %e = bf16[1024,2048]{1,0} collective-permute-done(%t)
  ROOT %r = (bf16[1024,2048]{1,0}, bf16[1024,2048]{1,0}) tuple(%d, %e)
}
"""


def test_a_collective_permute_reads_what_it_sends_and_writes_what_it_receives():
    # The first permute: 4 MiB read and 4 MiB written (its result names the source again, not a
    # third array); the copy into vector memory reads 4 MiB; the second permute writes 4 MiB.
    cost = hlo_cost.program_cost(PERMUTE, 2)
    assert cost.hbm_bytes == 2 * 4 * MIB + 4 * MIB + 4 * MIB
    # The link's share is the collective's own (its buffer once), unchanged.
    assert [c.bytes for c in cost.collectives] == [4 * MIB, 4 * MIB]
