"""What `mxc compile` ends with and `mxc inspect` prints: an artifact's manifest in brief.

Per-device memory is XLA's figure for the hungriest function (argument + output - alias +
temp), against the HBM a program may use on one device.
"""

from __future__ import annotations

from pathlib import Path

from mxc.runtime.artifact import Manifest


def hbm_per_device(manifest: Manifest) -> int:
    """What one program may use on one device (libtpu keeps part of each chip's HBM)."""
    topology = manifest.topology
    per_chip = topology.usable_hbm_bytes or topology.hbm_bytes
    return per_chip * topology.chips // topology.devices


def summary_json(manifest: Manifest, directory: str | Path | None = None) -> dict:
    topology = manifest.topology
    functions = {}
    for name, function in manifest.functions.items():
        functions[name] = {"inputs": len(function.inputs), "outputs": len(function.outputs),
                           "donated_arguments": [function.arguments[i] for i in function.donation],
                           "memory": function.memory.model_dump(), "cost": function.cost.model_dump(),
                           "seconds": function.seconds}
    peak = max((f.memory.total_bytes for f in manifest.functions.values()), default=0)
    hbm = hbm_per_device(manifest)
    data = {
        "model": manifest.model, "format_version": manifest.format_version,
        "topology": {"name": topology.name, "platform": topology.platform, "device_kind": topology.device_kind,
                     "chips": topology.chips, "devices": topology.devices, "mesh": topology.mesh},
        "versions": manifest.versions.model_dump(), "compiler_options": manifest.compiler_options,
        "spec_hash": manifest.spec_hash, "plan": manifest.plan, "run": manifest.run,
        "functions": functions,
        "memory": {"peak_bytes_per_device": peak, "hbm_bytes_per_device": hbm,
                   "fraction_of_hbm": peak / hbm if hbm else None, "fits": peak <= hbm},
        "estimate": None if manifest.estimate is None else manifest.estimate.model_dump(),
        "compile_seconds": manifest.compile_seconds, "created": manifest.created,
        "size_bytes": None,
    }
    if directory is not None:
        data["artifact"] = str(directory)
        data["size_bytes"] = sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
    return data


def render(summary: dict, console) -> None:
    from rich.table import Table

    from mxc.compiler.commands import units

    topology = summary["topology"]
    mesh = " x ".join(f"{axis}={size}" for axis, size in topology["mesh"].items())
    console.print(f"[bold]{summary['model']}[/] for [bold]{topology['name']}[/]: {topology['devices']} "
                  f"{topology['device_kind']} devices, mesh {mesh}")
    table = Table(title_justify="left", show_edge=False)
    for column in ("function", "args", "temp", "total/device", "XLA FLOPs", "compile"):
        table.add_column(column, justify="left" if column == "function" else "right")
    for name, function in summary["functions"].items():
        memory = function["memory"]
        flops = function["cost"]["flops"]
        table.add_row(name, units.size_bytes(memory["argument_bytes"]), units.size_bytes(memory["temp_bytes"]),
                      units.size_bytes(memory["total_bytes"]), "-" if flops is None else units.flops(flops),
                      units.duration(function["seconds"].get("compile", 0.0)))
    console.print(table)
    memory = summary["memory"]
    verdict = "[green]fits[/]" if memory["fits"] else "[red]does not fit[/]"
    console.print(f"memory per device: {units.size_bytes(memory['peak_bytes_per_device'])} of "
                  f"{units.size_bytes(memory['hbm_bytes_per_device'])} HBM "
                  f"({100 * (memory['fraction_of_hbm'] or 0):.1f}%): {verdict}")
    estimate = summary["estimate"]
    if estimate:
        line = (f"train step: {units.count(estimate['tokens_per_step'])} tokens, "
                f"{units.flops(estimate['train_flops_per_step'])} "
                f"({units.flops(estimate['flops_per_device'])} per device); "
                f"at peak FLOP/s {units.duration(estimate['step_seconds_at_peak'])}")
        if estimate.get("step_seconds") is not None:
            line += f", planner's estimate {units.duration(estimate['step_seconds'])}"
        console.print(line)
    for line in run_lines(summary["run"]):
        console.print(line)
    plan = summary["plan"]
    console.print(f"plan: remat {plan.get('remat')}, {plan.get('microbatches')} microbatch(es), "
                  f"attention {plan.get('attention', '-')}")
    versions = summary["versions"]
    console.print(f"built with jax {versions['jax']}, jaxlib {versions['jaxlib']}"
                  + (f", libtpu {versions['libtpu']}" if versions.get("libtpu") else "")
                  + (f", CUDA plugin {versions['cuda_plugin']}" if versions.get("cuda_plugin") else "")
                  + f", mxc {versions['mxc']}; compiled in {units.duration(summary['compile_seconds'])}")
    if summary.get("compiler_options"):
        console.print("compiler options: " + ", ".join(f"{k}={v}" for k, v in summary["compiler_options"].items()))
    if summary.get("artifact"):
        console.print(f"artifact: {summary['artifact']} ({units.size_bytes(summary['size_bytes'])})")


def run_lines(run: dict) -> list[str]:
    """What the functions were built for: shapes, the optimizer compiled into the train step, and
    with --serve the serving shapes (the runtime refuses other shapes, so a user needs them)."""
    lines = [f"shapes: seq {run['seq']}, batch {run['batch']} sequences"]
    if run.get("optimizer"):
        from mxc.compiler.lower.optimizer import OptimizerConfig

        o = OptimizerConfig.model_validate(run["optimizer"])
        lines.append(f"optimizer: AdamW, lr {o.learning_rate:g}, warmup {o.resolved_warmup_steps} steps, "
                     f"cosine to {o.min_lr_ratio:g} x by step {o.total_steps}")
        lines.append(f"  b1 {o.b1:g}, b2 {o.b2:g}, eps {o.eps:g}, weight decay {o.weight_decay:g}, "
                     f"clip norm {'none' if o.clip_norm is None else f'{o.clip_norm:g}'}")
    if run.get("serve"):
        lines.append(f"serve: batch {run['serve_batch']}, prompt {run['prompt_len']}, "
                     f"cache {run['cache_len']} tokens")
    images = run.get("serve_images")
    if images:  # a vision model's prefill takes each row's images in fixed slots (docs/multimodal.md)
        each = (f"one image token ({images['token']})" if images["entry"] == "cross_attention"
                else f"{images['tokens_per_image']} placeholder tokens ({images['token']})")
        lines.append(f"  images: {images['slots']} slot(s) per row, each image {each}")
    return lines
