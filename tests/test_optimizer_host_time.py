"""The formula's time for AdamW's moments on host (cost.optimizer_host_seconds) copies only the
moments that go there: on a TPU, libtpu lays out some pieces in HBM instead
(optimizer.host_tiles_accept, memory.hosted_moment_bytes), and those are not copied."""

from dataclasses import replace

from mxc.compiler.plan import cost, memory
from mxc.compiler.plan.candidates import choices
from mxc.compiler.plan.layout import parameters
from mxc.compiler.topology import parse
from mxc.spec.load import load_models


def test_only_the_moments_on_host_are_copied_over_the_host_link():
    # d_model 112 over fsdp 4: pieces of 28, which stay in HBM (tests/test_optimizer_offload_tiles.py);
    # kv_lora 128 (split like embed, rules.LOW_RANK): kv_b's pieces [32, 4, 32] go to the host.
    wider = [f"blocks.{block}.attention.kv_lora_rank=128" for block in ("dense", "moe")]
    spec = next(iter(load_models("mla-tiny", wider).values())).model_copy(update={"d_model": 112})
    topology = parse("v5p-8")
    choice = next(iter(choices(spec, parameters(spec), topology, 64, 16, {"fsdp": 4}, "full", 1)))
    on_host = replace(choice, optimizer_on_host=True)
    hosted, every = memory.hosted_moment_bytes(on_host), memory.optimizer_state_bytes(on_host)
    assert 0 < hosted < every
    assert cost.optimizer_host_seconds(on_host) == hosted / cost.host_bandwidth(topology.chip)
    assert cost.optimizer_host_seconds(choice) == 0.0
