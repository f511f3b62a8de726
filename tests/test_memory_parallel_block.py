"""What a parallel block keeps for the backward pass (activations.never_read): attention's output
only joins the residual stream, so no policy keeps it; checked against XLA's memory analysis of
parallel stand-ins compiled for TPU."""

from __future__ import annotations

import pytest

from mxc.compiler.plan.search import evaluate
from mxc.compiler.topology import parse
from mxc.spec.load import load_text

MIB = 2**20

# A small parallel block (MaxText's 2023 layer, tests/data/maxtext_synthetic.mspec, scaled down):
# 8 sequences of 2048 tokens a device on v5e-8 make a residual-shaped value 32 MiB in bfloat16.
PARALLEL = """
model parallel-small {
  vocab = 8192
  d_model = 1024
  max_seq = 2048
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-6)
  block x 2 {
    attention = mha(heads = 8, head_dim = 128, rope = rope(theta = 10000))
    mlp = mlp(hidden = 4096, act = relu)
    norm = rmsnorm(eps = 1e-6)
    parallel = true
  }
}
model parallel-small-6 extends parallel-small {
  block x 6 { }
}
model sequential-small extends parallel-small {
  block x 2 { parallel = false }
}
"""


def _plan(name: str, remat: str = "minimal"):
    spec = load_text(PARALLEL, "parallel.mspec")[name]
    return spec, evaluate(spec, parse("v5e-8"), seq=2048, batch=64, mesh={"fsdp": 8}, remat=remat)


def test_minimal_keeps_no_attention_output_in_a_parallel_block():
    # minimal keeps q/k/v (3 x 32 MiB), mlpwi (128) and the layer input (32); a sequential block
    # also keeps out_proj (32), which its second norm reads through the residual sum.
    assert _plan("parallel-small")[1].predicted.activations == 2 * (96 + 128 + 32) * MIB
    assert _plan("sequential-small")[1].predicted.activations == 2 * (96 + 32 + 128 + 32) * MIB
    # and offloading it moves nothing to host: the backward never reads it
    offload_out = "custom:out_proj=offload"
    assert _plan("parallel-small", offload_out)[1].predicted.host == 0
    assert _plan("sequential-small", offload_out)[1].predicted.host == 2 * 32 * MIB


@pytest.mark.slow
def test_four_more_parallel_layers_cost_what_xla_says():
    # XLA's totals (MiB): 2 layers 1119.0, 6 layers 2228.2: 4 layers' saved values and state add
    # 1109.2; predicted 1120 (1.010); counting out_proj as kept predicted 1248 (1.125). The rest of
    # the prediction (the layers' temporaries) is the same in both and cancels.
    from mxc.compiler.plan.verify import verify

    totals = {}
    for name in ("parallel-small", "parallel-small-6"):
        spec, plan = _plan(name)
        verdict = verify(spec, plan, parse("v5e-8"))
        assert verdict.memory is not None, verdict.reason
        totals[name] = (plan.predicted.total, verdict.memory.total)
    predicted = totals["parallel-small-6"][0] - totals["parallel-small"][0]
    xla = totals["parallel-small-6"][1] - totals["parallel-small"][1]
    assert abs(predicted / xla - 1) < 0.04, (predicted / MIB, xla / MIB)


# MaxText's 32B layer (tests/data/maxtext_synthetic.mspec), 4 layers, as its v5p-128 row runs it:
# fsdp 16 x tensor 4, the residual stream split over tensor (MaxText's activation_embed), minimal.
MAXTEXT_32B_4_LAYERS = """
model maxtext-32b-4 {
  vocab = 32768
  d_model = 10240
  max_seq = 2048
  embedding = embedding(tied = true)
  final_norm = rmsnorm(eps = 1e-6)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 4 {
    attention = mha(heads = 32, head_dim = 256, rope = rope(theta = 10000))
    mlp = mlp(hidden = 32768, act = relu)
    norm = rmsnorm(eps = 1e-6)
    parallel = true
  }
}
"""


def _maxtext_32b_v5p():
    spec = load_text(MAXTEXT_32B_4_LAYERS, "maxtext32.mspec")["maxtext-32b-4"]
    plan = evaluate(spec, parse("v5p-128"), seq=2048, batch=512, mesh={"fsdp": 16, "tensor": 4}, remat="minimal",
                    sequence_parallel=True)
    return spec, plan


def test_a_sequence_parallel_layer_holds_four_whole_residuals_in_its_backward():
    from mxc.compiler.plan import memory
    from mxc.compiler.plan.candidates import choices
    from mxc.compiler.plan.layout import parameters
    from mxc.compiler.plan.rules import sequence_parallel

    spec = load_text(MAXTEXT_32B_4_LAYERS, "maxtext32.mspec")["maxtext-32b-4"]
    found = [c for c in choices(spec, parameters(spec), parse("v5p-128"), 2048, 512, {"fsdp": 16, "tensor": 4},
                                "minimal", 1) if c.loss_chunks == 1]
    split = next(c for c in found if sequence_parallel(c.rules))
    plain = next(c for c in found if not sequence_parallel(c.rules))
    # 32 sequences a device row (batch over fsdp 16), 2048 tokens, d_model 10240, bfloat16: 1280 MiB
    assert memory.whole_residual_bytes(split) == 4 * 1280 * MIB
    assert memory.whole_residual_bytes(plain) == 0


@pytest.mark.slow
def test_maxtext_32b_on_v5p_within_5_percent_of_xla():
    # XLA 21225 MiB (its layer backward holds four bf16[32,2048,10240] beside the saved stacks of
    # 8448); predicted 20836 (0.982). Without the whole residuals 15716 (0.740); counting out_proj
    # as kept too, 16996 (0.801). The full 32-layer row: XLA 84.73 GiB, predicted 84.66 (0.999;
    # 0.940 without them, 1.058 before either change).
    from mxc.compiler.plan.verify import verify

    spec, plan = _maxtext_32b_v5p()
    verdict = verify(spec, plan, parse("v5p-128"))
    assert verdict.memory is not None, verdict.reason
    assert abs(plan.predicted.total / verdict.memory.total - 1) < 0.05, (plan.predicted, verdict.memory)
