"""The HLO reader's HBM bytes for what TPU programs do around their kernels: operands prefetched
into the chip's vector memory (`S(1)`) by asynchronous slices and copies, buffers set aside,
stacked layer buffers read one layer at a time through a nested fusion. Each is charged the
bytes it moves through HBM, not every array it names (the forms are those of Llama 3.1 8B's
train step compiled for v6e-256, docs/plans.md "Step time from the compiled program")."""

from mxc.compiler.plan import hlo_cost

MIB = 2**20

PREFETCH = """HloModule prefetch
ENTRY %main (a: s8[67108864], b: f32[1024,1024]) -> (s8[4194304], f32[1024,1024], bf16[64,1024,1024]) {
  %a = s8[67108864]{0:T(1024)} parameter(0)
  %b = f32[1024,1024]{1,0} parameter(1)
  %s = ((s8[67108864]{0:T(1024)}), s8[4194304]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:4194304]}
  %d = s8[4194304]{0:T(1024)S(1)} slice-done(%s)
  %c = (f32[1024,1024]{1,0:S(1)}, f32[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%b)
  %e = f32[1024,1024]{1,0:S(1)} copy-done(%c)
  %g = bf16[64,1024,1024]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %t = (s8[4194304]{0:T(1024)S(1)}, f32[1024,1024]{1,0:S(1)}, bf16[64,1024,1024]{2,1,0}) tuple(%d, %e, %g)
}
"""


def test_a_prefetch_into_vector_memory_reads_its_array_once():
    # The 4 MiB slice read from HBM once, the 4 MiB copy read once; the 64 MiB source, the
    # result's echo of it, the done and the 128 MiB buffer set aside move nothing.
    cost = hlo_cost.program_cost(PREFETCH, 1)
    assert cost.hbm_bytes == 4 * MIB + 4 * MIB


NESTED_SLICE = """HloModule nested
%inner (q0: bf16[32,1024,128], q1: s32[]) -> bf16[1024,128] {
  %q0 = bf16[32,1024,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,1024,128]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,1024,128}
  ROOT %r = bf16[1024,128]{1,0} bitcast(%ds)
}

%outer (p0: bf16[32,1024,128], p1: s32[], p2: bf16[1024,128]) -> bf16[1024,128] {
  %p0 = bf16[32,1024,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[1024,128]{1,0} parameter(2)
  %f = bf16[1024,128]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%inner
  ROOT %m = bf16[1024,128]{1,0} multiply(%f, %p2)
}

ENTRY %main (a: bf16[32,1024,128], i: s32[], b: bf16[1024,128]) -> bf16[1024,128] {
  %a = bf16[32,1024,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %b = bf16[1024,128]{1,0} parameter(2)
  ROOT %k = bf16[1024,128]{1,0} fusion(%a, %i, %b), kind=kLoop, calls=%outer
}
"""


def test_a_stacked_buffer_sliced_in_a_nested_fusion_moves_one_layer():
    # One layer (256 KiB) of the 32-layer stack read, the other operand read, the result written,
    # the index: not the 8 MiB stack.
    cost = hlo_cost.program_cost(NESTED_SLICE, 1)
    layer = 1024 * 128 * 2
    assert cost.hbm_bytes == 3 * layer + 4


PADDED_WINDOW = """HloModule padded
%window (q0: s32[], q1: bf16[1024,1,4096]) -> bf16[1024,2,256] {
  %q1 = bf16[1024,1,4096]{2,1,0} parameter(1)
  %ninf = bf16[] constant(-inf)
  %pad = bf16[1024,2,4096]{2,1,0} pad(%q1, %ninf), padding=0_0x0_1x0_0
  %z = s32[] constant(0)
  %q0 = s32[] parameter(0)
  ROOT %ds = bf16[1024,2,256]{2,1,0} dynamic-slice(%pad, %z, %z, %q0), dynamic_slice_sizes={1024,2,256}
}

%matmul (p0: s32[], p1: bf16[1024,1,4096], p2: bf16[512,2,256]) -> bf16[1024,512] {
  %p0 = s32[] parameter(0)
  %p1 = bf16[1024,1,4096]{2,1,0} parameter(1)
  %p2 = bf16[512,2,256]{2,1,0} parameter(2)
  %w = bf16[1024,2,256]{2,1,0} fusion(%p0, %p1), kind=kLoop, calls=%window
  ROOT %d = bf16[1024,512]{1,0} dot(%w, %p2), lhs_contracting_dims={1,2}, rhs_contracting_dims={1,2}
}

ENTRY %main (i: s32[], a: bf16[1024,1,4096], b: bf16[512,2,256]) -> bf16[1024,512] {
  %i = s32[] parameter(0)
  %a = bf16[1024,1,4096]{2,1,0} parameter(1)
  %b = bf16[512,2,256]{2,1,0} parameter(2)
  ROOT %k = bf16[1024,512]{1,0} fusion(%i, %a, %b), kind=kOutput, calls=%matmul
}
"""


def test_a_window_of_a_padded_operand_reads_the_window():
    # XLA's windowed einsums pad an activation shard and slice one window of it per iteration
    # (MaxText's 128B setting on v5p-512, docs/plans.md "Published results outside the fit"):
    # the window's data (512 KiB: its second row is padding) is read, not the 8 MiB operand; the
    # other operand (512 KiB) read, the result (1 MiB) written, the index.
    cost = hlo_cost.program_cost(PADDED_WINDOW, 1)
    assert cost.hbm_bytes == 1024 * 1 * 256 * 2 + 512 * 2 * 256 * 2 + 1024 * 512 * 2 + 4
