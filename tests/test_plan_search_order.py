"""The order the verified search compiles its candidates in, after XLA refuses one for memory."""

from __future__ import annotations

from mxc.compiler.lower import remat
from mxc.compiler.plan.candidates import choices, score
from mxc.compiler.plan.explain import Verdicts
from mxc.compiler.plan.layout import parameters
from mxc.compiler.plan.plan import OUT_OF_HBM, Verification
from mxc.compiler.plan.rules import sequence_parallel
from mxc.compiler.plan.search import _to_compile
from mxc.compiler.topology import parse
from mxc.spec.load import load_model

OFFLOAD = "offload"
QKV = dict(query_proj=OFFLOAD, key_proj=OFFLOAD, value_proj=OFFLOAD)
QKVO = remat.custom(decoder_layer_input=OFFLOAD, **QKV, out_proj=OFFLOAD)


def _scored(spec, topology, mesh: dict, policy: str, split_stream: bool = True):
    found = [score(c) for c in choices(spec, parameters(spec), topology, 8192, 512, mesh, policy, 1)
             if sequence_parallel(c.rules) == split_stream and getattr(c, "loss_chunks", 1) == 1]  # whole loss
    assert len(found) == 1
    return found[0]


def test_a_refused_squeezed_plan_passes_over_the_plans_it_condemns_and_keeps_the_order():
    """Llama 3.1 405B on 2 x v6e-256: XLA refuses the formula's first choice (fsdp 256 x tensor 2,
    q/k/v/out and the layer input offloaded; 38.48 GiB of temporaries) and fits MaxText's own
    setting (fsdp 128 x tensor 4, the same policy: 30.14 GiB). Both are predicted squeezed; after
    the refusal the search goes on in its order to MaxText's setting, not to the plans without a
    lever, and passes over the same mesh with fewer names offloaded (the same irreducible part)."""
    spec, topology = load_model("llama3.1-405b"), parse("v6e-256", 2)
    refused = _scored(spec, topology, {"fsdp": 256, "tensor": 2}, QKVO)
    same_mesh = _scored(spec, topology, {"fsdp": 256, "tensor": 2}, remat.custom(decoder_layer_input=OFFLOAD, **QKV))
    maxtext = _scored(spec, topology, {"fsdp": 128, "tensor": 4}, QKVO)
    plain = _scored(spec, topology, {"fsdp": 16, "context": 4, "tensor": 8}, "save_qkv_proj", split_stream=False)
    verdicts, passed = {}, {}
    order = _to_compile([refused, same_mesh, maxtext, plain], verdicts, attempts=3, passed=passed)
    assert next(order) is refused
    verdicts[refused.choice] = Verification(
        status="rejected", reason=f"{OUT_OF_HBM}, its temporaries need 38.48GiB of 31.24GiB available")
    assert next(order) is maxtext
    verdicts[maxtext.choice] = Verification(status="fits")
    assert next(order) is plain  # what a third attempt would be, had MaxText's setting been refused
    # --explain says why the faster plan on the refused mesh was not compiled
    assert list(passed) == [same_mesh.choice]
    why = Verdicts(verdicts, topology.usable_hbm_bytes, None, passed).why_lost(same_mesh, maxtext)
    assert why.startswith("passed over: XLA refused fsdp 256, tensor 2") and "0.68" in why


def test_a_refused_plan_that_was_not_squeezed_passes_over_the_bigger_ones_of_its_kind():
    spec, topology = load_model("llama3.1-405b"), parse("v6e-256", 2)
    plans = [_scored(spec, topology, {"fsdp": 16, "context": 4, "tensor": 8}, name, split_stream=False)
             for name in ("save_qkv_proj", "full")]
    bigger, smaller = sorted(plans, key=lambda s: -s.memory.total)
    verdicts: dict = {}
    order = _to_compile([bigger, bigger, smaller], verdicts, attempts=3)
    assert next(order) is bigger
    verdicts[bigger.choice] = Verification(status="over_hbm", reason=f"{OUT_OF_HBM}, its peak ...")
    assert next(order) is smaller


def test_compare_keeps_the_fitting_plan_whose_compiled_program_reads_fastest(monkeypatch):
    """`compare=2` compiles on past the first plan that fits and keeps the one the compiled programs'
    estimates rank first (Llama 3.1 8B on v6e-256: the formula's first choice reads 35.6% from its
    program, MaxText's mesh and policy 50.5%); `compare=1` keeps the first that fits."""
    from mxc.compiler.plan import search

    compiled = []

    def later_reads_faster(spec, candidate, topology):
        compiled.append(candidate)
        return Verification(status="fits", time=candidate.time.model_copy(update={"step_s": 10.0 / len(compiled)}))

    monkeypatch.setattr(search, "_verify", later_reads_faster)
    spec, topology = load_model("llama3-tiny"), parse("v5p-8")
    first = search.plan(spec, topology, seq=64, batch=16, compare=1)
    assert len(compiled) == 1 and first.time.step_s == 10.0
    compiled.clear()
    second = search.plan(spec, topology, seq=64, batch=16, compare=2)
    assert len(compiled) == 2 and second.time.step_s == 5.0
    assert any(reason.startswith("ranked by their compiled programs' estimates among the 2") for reason in second.reasons)
