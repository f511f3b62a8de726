"""A Plan as text for people: what was chosen, the memory predicted and as XLA reports it, the
estimated step time, why, and what lost."""

from __future__ import annotations

from mxc.compiler.commands.units import duration, rate, size_bytes
from mxc.compiler.plan.plan import MESH_AXES, Plan


def _size(value: int | float | None) -> str:
    return "-" if value is None else size_bytes(value)


def verdict_text(plan: Plan) -> str:
    xla = plan.xla
    if xla.status == "fits":
        return f"yes: XLA's peak {_size(xla.memory.total)} of {_size(plan.hbm_bytes)} HBM"
    if xla.status in ("unavailable", "skipped"):
        predicted = "predicted to fit" if plan.fits else "predicted not to fit"
        return f"{'yes' if plan.fits else 'no'}: {predicted} ({_size(plan.predicted.total)} of " \
               f"{_size(plan.hbm_bytes)}); XLA verification {xla.status}: {xla.reason}"
    return f"no: {xla.reason}"


def memory_rows(plan: Plan) -> list[tuple[str, str, str]]:
    p, x = plan.predicted, plan.xla.memory
    rows = [("parameters", _size(p.parameters), _size(x and x.parameters)),
            ("optimizer state", _size(p.optimizer_state), _size(x and x.optimizer_state)),
            ("gradients", _size(p.gradients), ""),
            ("activations", _size(p.activations), ""),
            ("temporaries", _size(p.temporaries), ""),
            ("  XLA temporaries (gradients, activations, scratch)", "",
             _size(x and x.temporaries)),
            ("this device's tokens, outputs, code", "", _size(x and (x.batch + x.outputs + x.generated_code))),
            ("total", _size(p.total), _size(x and x.total))]
    if x is not None:
        rows.append(("predicted / XLA", f"{p.total / x.total:.3f}", ""))
    if p.host or (x and x.host_temporaries):
        rows.append(("host memory (offloaded)", _size(p.host), _size(x and x.host_temporaries)))
    rows.append(("HBM", _size(plan.hbm_bytes), ""))
    if plan.serving_kv_cache:
        rows.append((f"KV cache for serving {plan.batch} x {plan.seq} tokens", _size(plan.serving_kv_cache), ""))
    return rows


def plan_text(plan: Plan, explain: bool = True) -> str:
    """The plan as text; `explain` adds why each choice was made and the candidates that lost."""
    slices = f" x {plan.slices} slices" if plan.slices > 1 else ""
    lines = [f"plan for {plan.model} on {plan.topology}{slices} ({plan.chips} {plan.chip} chips): "
             f"seq {plan.seq}, batch {plan.batch}",
             f"  fits          {verdict_text(plan)}",
             f"  mesh          {plan.mesh_text()}   ({' x '.join(f'{a} {plan.mesh.get(a, 1)}' for a in MESH_AXES)})",
             f"  rules         " + "; ".join(f"{k} -> {', '.join(v) or '-'}" for k, v in plan.rules.items()),
             f"  remat         {plan.remat}",
             f"  microbatches  {plan.microbatches} ({plan.batch // plan.microbatches} sequences each)",
             f"  attention     {plan.attention}"]
    if plan.lowering is not None and plan.lowering.loss_chunks > 1:
        lines.append(f"  loss          in {plan.lowering.loss_chunks} pieces of the sequence (float32 logits of one "
                     "piece at a time)")
    if plan.lowering is not None and plan.lowering.optimizer_state_on_host:
        lines.append("  optimizer     AdamW's moments in host memory between steps, brought to HBM for the update")
    if plan.pins:
        lines.append("  pinned        " + ", ".join(f"{k}={v}" for k, v in plan.pins.items()))
    lines += ["", f"  {'memory per device':<52}{'predicted':>12}{'XLA':>12}"]
    lines += [f"    {name:<50}{predicted:>12}{xla:>12}" for name, predicted, xla in memory_rows(plan)]
    if plan.xla.compile_seconds is not None:
        lines.append(f"    (XLA compiled the train step in {duration(plan.xla.compile_seconds)})")
    if plan.time is not None:
        t = plan.time
        comm = ", ".join(f"{k} {duration(v)}" for k, v in t.communication.items()) or "none"
        source = "from the compiled program" if t.source == "compiled program" else "by formula, not compiled"
        lines += ["", f"  step time (estimated {source})",
                  f"    compute         {duration(t.compute_s)}",
                  f"    memory traffic  {duration(t.memory_s)}",
                  f"    communication   {duration(t.communication_s)} ({comm}); exposed {duration(t.exposed_communication_s)}",
                  f"    pipeline bubble {t.bubble_fraction:.1%} of the step ({plan.mesh.get('stage', 1)} stage"
                  f"{'s' if plan.mesh.get('stage', 1) > 1 else ''})",
                  f"    step            {duration(t.step_s)}: {rate(t.tokens_per_s, 'tokens/s')} "
                  f"({rate(t.tokens_per_s_per_device, 'tokens/s')} per device), MFU {t.mfu:.1%}"]
    if explain and plan.reasons:
        lines += ["", "  why"] + [f"    - {reason}" for reason in plan.reasons]
    if plan.advice:
        lines += ["", "  what would make it fit"] + [f"    - {item}" for item in plan.advice]
    if explain and plan.candidates:
        lines += ["", "  next candidates"]
        for c in plan.candidates:
            mesh = ", ".join(f"{k} {v}" for k, v in c.mesh.items())
            step = "-" if c.step_s is None else duration(c.step_s)
            loss = f"; loss in {c.loss_chunks} pieces" if c.loss_chunks > 1 else ""
            lines.append(f"    {mesh}; remat {c.remat}; {c.microbatches} mb{loss}: {_size(c.predicted_bytes)}, "
                         f"{step}: {c.lost_because}")
    return "\n".join(lines)
