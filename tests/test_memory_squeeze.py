"""Which plans the memory model squeezes (memory.predict_squeezed: XLA rematerialising near the HBM
limit), as the verified search reads them: search._squeezed_share decides which candidates an
out-of-memory refusal condemns, so a plan predicted as asked must not count as squeezed."""

from __future__ import annotations

from dataclasses import replace

from mxc.compiler.plan import memory
from mxc.compiler.plan.candidates import choices, score
from mxc.compiler.plan.layout import parameters
from mxc.compiler.plan.rules import sequence_parallel
from mxc.compiler.plan.search import _squeezed_share
from mxc.compiler.topology import parse
from mxc.spec.load import load_model

LAYER_INPUT = "custom:decoder_layer_input=offload"


def _scored(model: str, topology, mesh: dict, policy: str, seq: int, batch: int, **changes):
    spec = load_model(model)
    found = [score(replace(c, **changes)) for c in choices(spec, parameters(spec), topology, seq, batch, mesh, policy, 1)
             if not sequence_parallel(c.rules) and c.loss_chunks == 1]
    assert len(found) == 1
    return found[0]


def _activations_host(item) -> int:
    """The host bytes of a plan's offloaded activations (Memory.host less the moments kept there)."""
    hosted = memory.hosted_moment_bytes(item.choice) if item.choice.optimizer_on_host else 0
    return item.memory.host - memory.MOMENT_COPIES_ON_HOST * hosted


def test_a_plan_predicted_without_the_held_logits_is_not_squeezed():
    # Llama 3.1 405B on 2 x v6e-256, fsdp 512, layer input offloaded, moments on host (XLA 27.19 GiB,
    # tests/test_memory_offload_staging.py): holding the logits through the layers' backward would put
    # it above memory.SQUEEZED_SHARE of HBM, so it is predicted without them, below what it asks with
    # them; that is no squeeze, and its irreducible part says nothing about a refusal.
    item = _scored("llama3.1-405b", parse("v6e-256", 2), {"fsdp": 512}, LAYER_INPUT, 8192, 512,
                   optimizer_on_host=True)
    asked, _, unheld = memory.temporaries_parts(item.choice, _activations_host(item))
    assert item.memory.temporaries == int(unheld) < asked
    assert item.squeezed_to is None
    assert _squeezed_share(item) is None


def test_moments_on_host_do_not_make_a_plan_squeezed():
    # llama3-tiny on v5p-8 fits as asked; its moments in host memory are no offloaded activations
    # (no copies in flight, no logits held for them).
    item = _scored("llama3-tiny", parse("v5p-8"), {"fsdp": 4}, "full", 64, 16, optimizer_on_host=True)
    assert item.memory.host > 0 and _activations_host(item) == 0
    assert item.memory.temporaries == int(memory.temporaries_parts(item.choice, 0)[0])
    assert item.squeezed_to is None
    assert _squeezed_share(item) is None


def test_a_squeezed_plan_reports_its_irreducible_part():
    # Llama 3.1 405B on 2 x v6e-256, fsdp 128 x tensor 4, q/k/v/out and the layer input offloaded,
    # four sequences a device: it asks for more than the room beside its state, its irreducible part
    # fits, and it is predicted at memory.SQUEEZED_SHARE of HBM.
    policy = ("custom:decoder_layer_input=offload,query_proj=offload,key_proj=offload,value_proj=offload,"
              "out_proj=offload")
    item = _scored("llama3.1-405b", parse("v6e-256", 2), {"fsdp": 128, "tensor": 4}, policy, 8192, 512)
    asked, irreducible, _ = memory.temporaries_parts(item.choice, _activations_host(item))
    assert item.memory.temporaries < asked
    assert item.squeezed_to == irreducible
    room = item.choice.topology.usable_hbm_bytes - (item.memory.total - item.memory.temporaries)
    assert abs(item.memory.total - memory.SQUEEZED_SHARE * item.choice.topology.usable_hbm_bytes) <= 1
    assert _squeezed_share(item) == irreducible / room < 1
