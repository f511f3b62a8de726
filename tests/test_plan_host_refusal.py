"""After XLA refuses a candidate that keeps AdamW's moments on host for a reason other than memory
(libtpu rejecting the host layouts), the search passes over the other on-host candidates and says
why in --explain (candidates.condemned_with_moments_on_host; DeepSeek V3 671B on v5p-1024 once
failed all 8 of --attempts 8 with one bitcast error)."""

from dataclasses import replace

from mxc.compiler.plan.candidates import choices, score
from mxc.compiler.plan.explain import Verdicts
from mxc.compiler.plan.layout import parameters
from mxc.compiler.plan.plan import Verification
from mxc.compiler.plan.search import _to_compile
from mxc.compiler.topology import parse
from mxc.spec.load import load_model

BITCAST = ("XLA: INTERNAL: during context [post-optimization]: %bitcast.1043 = f32[1024,28]{1,0:T(1,128)S(5)} "
           "bitcast(%param.710): Bitcast cannot have different shape sizes of output (524288) and operand (114688)")


def _candidates():
    spec, topology = load_model("llama3-tiny"), parse("v5p-8")
    found = [score(c) for policy in ("full", "minimal")
             for c in choices(spec, parameters(spec), topology, 64, 16, {"fsdp": 4}, policy, 1)]
    plain = found[0]
    on_host = [score(replace(s.choice, optimizer_on_host=True)) for s in found[:2]]
    return topology, on_host, plain


def test_a_host_layout_refusal_passes_over_the_other_candidates_with_moments_on_host():
    topology, (first, second), plain = _candidates()
    verdicts, passed = {}, {}
    order = _to_compile([first, second, plain], verdicts, attempts=3, passed=passed)
    assert next(order) is first
    verdicts[first.choice] = Verification(status="rejected", reason=BITCAST)
    assert next(order) is plain
    assert list(passed) == [second.choice]
    why = Verdicts(verdicts, topology.usable_hbm_bytes, None, passed).why_lost(second, plain)
    assert why.startswith("passed over: XLA refused") and "moments on host, not for memory" in why


def test_a_refusal_of_a_plan_with_the_moments_in_hbm_leaves_those_on_host():
    topology, (first, second), plain = _candidates()
    verdicts: dict = {}
    order = _to_compile([plain, first, second], verdicts, attempts=3)
    assert next(order) is plain
    verdicts[plain.choice] = Verification(status="rejected", reason="XLA: UNIMPLEMENTED: something else")
    assert next(order) is first
