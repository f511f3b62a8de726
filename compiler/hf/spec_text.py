"""A ModelSpec written back as .mspec text.

Fields left at their IR default are omitted, so the text reads like a hand-written zoo entry.
The importer loads the text back and checks that it gives the very same spec.
"""

from __future__ import annotations

from pydantic import BaseModel

from mxc.spec.ir import ModelSpec, Segment

_TOP_LEVEL = ("vocab", "d_model", "max_seq", "embedding", "final_norm", "final_softcap", "param_dtype",
              "compute_dtype")


def value_text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        mantissa, _, exponent = repr(value).partition("e")
        return mantissa if not exponent else f"{mantissa}e{int(exponent)}"  # 1e-06 -> 1e-6
    if isinstance(value, str):
        return value  # enum members (silu, sqrt_d_model, bfloat16) are bare names
    if isinstance(value, BaseModel):
        return call_text(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    raise TypeError(f"no .mspec form for {value!r}")


_LEADING = ("heads", "kv_heads", "head_dim")  # read first, as the papers state them


def _explicit_fields(node: BaseModel) -> list[tuple[str, object]]:
    """Fields that are required or differ from their default, sizes first."""
    fields = type(node).model_fields
    order = [n for n in _LEADING if n in fields] + [n for n in fields if n not in _LEADING]
    out = []
    for name in order:
        field = fields[name]
        if name == "kind":
            continue
        value = getattr(node, name)
        if field.is_required() or value != field.default:
            out.append((name, value))
    return out


def call_text(node: BaseModel) -> str:
    args = ", ".join(f"{name} = {value_text(value)}" for name, value in _explicit_fields(node))
    return f"{node.kind}({args})"


def _segment_text(segment: Segment) -> str:
    runs: list[list] = []
    for name in segment.period:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    parts = [name if count == 1 else f"{name} x {count}" for name, count in runs]
    if len(segment.period) == 1:
        return parts[0] if segment.repeat == 1 else f"{parts[0]} x {segment.repeat}"
    return f"({', '.join(parts)}) x {segment.repeat}"


def spec_text(spec: ModelSpec, header: str = "") -> str:
    """The .mspec text of `spec` (with `header` as leading comment lines)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines.append(f"model {spec.name} {{")
    for name in _TOP_LEVEL:
        value = getattr(spec, name)
        field = ModelSpec.model_fields[name]
        if field.is_required() or value != field.default or name.endswith("dtype"):
            lines.append(f"  {name} = {value_text(value)}")
    single = len(spec.blocks) == 1 and len(spec.layers) == 1 and len(spec.layers[0].period) == 1
    for block_name, block in spec.blocks.items():
        if single:
            label = "" if block_name == "block" else f" {block_name}"
            lines.append(f"  block{label} x {spec.layers[0].repeat} {{")
        else:
            lines.append(f"  block {block_name} {{")
        for field, value in _explicit_fields(block):
            lines.append(f"    {field} = {value_text(value)}")
        lines.append("  }")
    if not single:
        lines.append("  layers = " + ", ".join(_segment_text(s) for s in spec.layers))
    if spec.mtp is not None:
        lines.append(f"  mtp = {value_text(spec.mtp)}")
    if spec.vision is not None:
        lines.append(f"  vision = {value_text(spec.vision)}")
    if spec.shard:
        lines.append("  shard { " + "  ".join(f"{axis} -> ({', '.join(mesh)})" for axis, mesh in spec.shard.items())
                     + " }")
    if spec.mesh:
        lines.append("  mesh { " + "  ".join(f"{axis} = {size}" for axis, size in spec.mesh.items()) + " }")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    return _formatted(text)


def _formatted(text: str) -> str:
    try:
        from mxc.spec.format import format_text
    except ImportError:
        return text
    return format_text(text)
