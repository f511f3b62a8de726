"""The memory model's peak at the loss (memory.loss_peak_bytes) against what XLA's buffer
assignment holds there, for programs with and without XLA's collective-matmul loops
(xla_options.collective_matmul_loops; docs/plans.md, "Collective matmul")."""

from __future__ import annotations

import pytest

from mxc.compiler.plan import memory
from mxc.compiler.plan.candidates import choices
from mxc.compiler.plan.layout import parameters
from mxc.compiler.plan.rules import sequence_parallel
from mxc.compiler.plan.search import evaluate
from mxc.compiler.topology import parse
from mxc.compiler.xla_options import collective_matmul_loops, compiler_options
from mxc.spec.load import load_model, load_text

from test_memory_levers import SMALL_LLAMA  # the 8-layer Llama of its TPU compiles

MIB = 2**20


def _choice(mesh: dict, batch: int):
    spec = load_text(SMALL_LLAMA, "levers.mspec")["llama-levers"]
    found = [c for c in choices(spec, parameters(spec), parse("v5e-8"), 4096, batch, mesh, "full", 1)
             if not sequence_parallel(c.rules) and c.loss_chunks == 1]
    assert len(found) == 1
    return found[0]


def test_without_the_loops_the_loss_holds_the_logits_once_and_the_heads_gradient():
    # fsdp 8, two 4096-token sequences a device, compiled without the loops: at the loss XLA's
    # buffer assignment holds f32[2,4096,32000] (1000 MiB), the head's gradient f32[2048,32000]
    # (250 MiB) and its gathered weight bf16[2048,32000] (125 MiB); no bfloat16 logits gradient.
    # The model also counts the bfloat16 copy of the head's gradient that Llama 3.1 8B's program on
    # v6e-256 all-reduces (memory.HEAD_GRADIENT_BUFFERS; this one reduce-scatters the float32 one).
    choice = _choice({"fsdp": 8}, 16)
    assert not collective_matmul_loops("tpu", choice.mesh)
    assert memory.loss_logits_bytes(choice) == 1000 * MIB
    assert memory.head_gradient_bytes(choice) == 250 * MIB
    assert memory.loss_peak_bytes(choice) == (1000 + 250 + 125 + 125) * MIB
    # at four sequences a device the logits double and the head's gradient does not (XLA: 2000 and 250 MiB)
    assert memory.loss_peak_bytes(_choice({"fsdp": 8}, 32)) == (2000 + 250 + 125 + 125) * MIB


def test_with_a_tensor_axis_the_loss_keeps_the_loops_rule():
    choice = _choice({"fsdp": 2, "tensor": 4}, 16)
    assert collective_matmul_loops("tpu", choice.mesh)
    logits, gathered = memory.loss_logits_bytes(choice), memory.one_gathered_layer_bytes(choice)
    assert memory.loss_peak_bytes(choice) == 1.5 * logits + 2 * gathered


def test_the_loops_are_on_exactly_where_mxc_does_not_turn_them_off():
    spec = load_text(SMALL_LLAMA, "levers.mspec")["llama-levers"]
    option = "xla_jf_spmd_threshold_for_windowed_einsum_mib"
    for platform in ("tpu", "gpu", "cpu"):
        for mesh in ({"fsdp": 8}, {"fsdp": 2, "tensor": 4}, {"data": 8}):
            turned_off = option in compiler_options(spec, platform, mesh)
            assert collective_matmul_loops(platform, mesh) == (platform == "tpu" and not turned_off)


# Llama 3.1 8B on v6e-256, fsdp 256, full remat, 8192-token sequences, compiled without the loops:
# XLA's total in HBM (GiB) by sequences a device (2: 28 November, its buffer assignment read at the
# loss; 1 and 4: memory.py's comments, tests/test_memory_offload_staging.py).
LLAMA_8B_XLA_GIB = {1: 10.36, 2: 16.52, 4: 27.92}


@pytest.mark.parametrize("per_device", sorted(LLAMA_8B_XLA_GIB))
def test_llama_8b_without_the_loops_within_5_percent_of_xla(per_device):
    # The loss sets the peak in all three; the loops' rule read 0.883, 1.031 and (squeezed) 1.007.
    plan = evaluate(load_model("llama3.1-8b"), parse("v6e-256"), seq=8192, batch=256 * per_device,
                    mesh={"fsdp": 256}, remat="full")
    assert abs(plan.predicted.total / 2**30 / LLAMA_8B_XLA_GIB[per_device] - 1) < 0.05
