"""MaxText's published results against mxc: each recipe's own setting compiled through
`--maxtext`, and mxc's automatic plan, both estimated by the calibrated step-time model.

For every row of tests/data/published_mfu.json (MaxText's published pre-training throughput with
its tuning parameters), this compiles the train step for the real topology on this host
(libtpu's topology description, no TPU needed):

  1. MaxText's setting, exactly as `mxc plan MODEL --topology T --seq S --maxtext KEY=VALUE ...`
     does: whether XLA fits it, XLA's peak, the estimated MFU and tokens/s/device from the
     compiled program, next to the published ones;
  2. mxc's automatic plan, with its estimate from its compiled program.

The compiled programs' cost terms (kernels, collectives, host copies) are saved (--terms) so the
constants can be fitted again without compiling (--fit): the fit and each row's leave-one-out
error are printed.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 nohup .venv/bin/python bench/plan_recipes.py \
        --terms tests/data/calibration_terms.json --json bench.jsonl > bench.log 2>&1 &
    .venv/bin/python bench/plan_recipes.py --fit          # refit from the saved terms only

Each compile of a full-size model for 256-512 chips takes 0.5-2 minutes of CPU and several GiB
here; the rows run one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TERMS = ROOT / "tests" / "data" / "calibration_terms.json"
# Where a setting does not fit the real chip's HBM, its program is compiled for this chip (as
# many devices, Google's core-counting name: v5p-512 is 256 chips) to read its costs.
STAND_IN = {"v6e": "v5p", "v5e": "v5p"}


def _estimate_row(label: str, plan) -> dict:
    xla = plan.xla.memory
    return {
        "setting": label, "mesh": plan.mesh_text(), "remat": plan.remat, "microbatches": plan.microbatches,
        "xla_status": plan.xla.status, "xla_reason": plan.xla.reason,
        "xla_gib": None if xla is None else round(xla.total / GIB, 2),
        "predicted_gib": round(plan.predicted.total / GIB, 2),
        "step_s": round(plan.time.step_s, 3), "mfu": round(plan.time.mfu, 4),
        "tokens_per_s_per_device": round(plan.time.tokens_per_s_per_device, 1),
        "estimate_from": plan.time.source, "compile_s": plan.xla.compile_seconds,
    }


def _print(row: dict, published: dict | None = None) -> None:
    xla = "-" if row["xla_gib"] is None else f"{row['xla_gib']:.1f} GiB"
    against = ""
    if published:
        against = (f" (published {published['published_mfu']:.1%}, "
                   f"{published['published_tokens_per_s_per_device']} tokens/s/device; "
                   f"{row['mfu'] / published['published_mfu'] - 1:+.1%})")
    reason = f": {row['xla_reason']}" if row["xla_status"] != "fits" and row["xla_reason"] else ""
    print(f"  {row['setting']:<8} {row['mesh']}; {row['remat']}; {row['microbatches']} mb\n"
          f"           XLA {row['xla_status']}{reason}, peak {xla}, predicted {row['predicted_gib']:.1f} GiB\n"
          f"           estimate ({row['estimate_from']}): step {row['step_s']:.2f} s, MFU {row['mfu']:.1%}, "
          f"{row['tokens_per_s_per_device']:.0f} tokens/s/device{against}", flush=True)


def compile_rows(args) -> int:
    from mxc.compiler.plan import plan
    from mxc.compiler.plan.calibration import published_rows
    from mxc.compiler.plan.maxtext import plan_setting
    from mxc.compiler.topology import parse
    from mxc.spec.load import load_model

    saved = json.loads(Path(args.terms).read_text()) if args.terms and Path(args.terms).exists() else {}
    for row in published_rows():
        if args.only and args.only not in (row["model"], row["name"]):
            continue
        if args.skip_done and row["name"] in saved:
            continue
        spec = load_model(row["model"])
        topology = parse(row["topology"], row["slices"])
        print(f"\n{row['name']}: {row['model']} on {row['topology']}"
              + (f" x {row['slices']} slices" if row["slices"] > 1 else "")
              + f", seq {row['seq']}, batch {row['global_batch']} ({row['maxtext_config']})", flush=True)
        terms: list = []
        texts: list = []
        fixed = plan_setting(spec, topology, row["tuning_params"], seq=row["seq"], terms=terms, texts=texts,
                             verify=not args.maxtext_unverified)
        print("  " + "\n  ".join(r for r in fixed.reasons if r.startswith("maxtext: ")), flush=True)
        results = [_estimate_row("MaxText", fixed)]
        _print(results[-1], row)
        stand_in = STAND_IN.get(topology.chip.name)
        if not terms and fixed.xla.out_of_memory and stand_in:
            # XLA refuses the setting for memory on the real chip: read its program compiled for
            # a chip with more HBM, as many devices, sized for the real one.
            from mxc.compiler.plan.verify import estimate_on_stand_in

            other = parse(f"{stand_in}-{topology.chips_per_slice * 2}", topology.slices)
            time, program = estimate_on_stand_in(spec, fixed, topology, other, texts)
            terms.append(program)
            results.append({**_estimate_row("MaxText", fixed.model_copy(update={"time": time})),
                            "estimate_from": f"program compiled for {other.name}" + (
                                f" x {other.slices}" if other.slices > 1 else "")})
            _print(results[-1], row)
        if texts and args.hlo:
            Path(args.hlo).mkdir(parents=True, exist_ok=True)
            (Path(args.hlo) / f"{row['model']}_{row['topology']}x{row['slices']}.hlo").write_text(texts[-1])
        if terms and args.terms:
            saved[row["name"]] = {"status": fixed.xla.status, "compiled_for": results[-1]["estimate_from"],
                                  "terms": terms[0].to_json()}
            Path(args.terms).write_text(json.dumps(saved, indent=1) + "\n")
        if not args.no_auto:
            automatic = plan(spec, topology, seq=row["seq"], batch=row["global_batch"], attempts=2,
                             verify=not args.auto_unverified,
                             progress=lambda message: print(f"    mxc plan: {message}", flush=True))
            results.append(_estimate_row("mxc", automatic))
            _print(results[-1], row)
        if args.json:
            with open(args.json, "a") as out:
                for result in results:
                    out.write(json.dumps({"row": row["name"], **result}) + "\n")
    return 0


def reread_rows(args) -> int:
    """Recompute the rows' terms from HLO kept in a folder (after a change to the reader), or take
    a row's terms from its program's HLO for the first time: where jax cannot read a compiled
    program back (Mixtral on v6e-256), XLA's own dump of the compile has it
    (XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_flat", the
    *after_optimizations.txt file, copied to DIR/MODEL_TOPOLOGYxSLICES.hlo)."""
    from mxc.compiler.plan.calibration import published_rows
    from mxc.compiler.plan.maxtext import plan_setting
    from mxc.compiler.plan.verify import estimate_from_text, plan_mesh
    from mxc.compiler.topology import parse
    from mxc.spec.load import load_model

    saved = json.loads(Path(args.terms).read_text())
    for row in published_rows():
        path = Path(args.reread) / f"{row['model']}_{row['topology']}x{row['slices']}.hlo"
        if not path.exists():
            continue
        spec, topology = load_model(row["model"]), parse(row["topology"], row["slices"])
        fixed = plan_setting(spec, topology, row["tuning_params"], seq=row["seq"], verify=False)
        time, terms = estimate_from_text(spec, fixed, topology, path.read_text(), plan_mesh(fixed, topology))
        entry = saved.setdefault(row["name"], {"status": "fits", "compiled_for": f"compiled program (HLO from {path.name})"})
        entry["terms"] = terms.to_json()
        print(f"{row['name']}: MFU {time.mfu:.1%}, step {time.step_s:.2f} s (published {row['published_mfu']:.1%})")
    Path(args.terms).write_text(json.dumps(saved, indent=1) + "\n")
    return 0


def fit_rows(args) -> int:
    from mxc.compiler.plan.calibration import FITTED, calibration_rows, leave_one_out

    rows, skipped = calibration_rows(Path(args.terms))
    for name, why in skipped:
        print(f"not fitted on {name}: {why}")
    constants, table = leave_one_out(rows)
    print(f"constants fitted on {len(rows)} rows: {constants}")
    print(f"constants in mxc.compiler.plan.calibration: {FITTED}")
    print(f"{'row':<32}{'published':>10}{'in-sample':>11}{'error':>8}{'left out':>10}{'error':>8}")
    for v in table:
        print(f"{v.name:<32}{v.published_mfu:>10.1%}{v.in_sample_mfu:>11.1%}{v.in_sample_error:>+8.1%}"
              f"{v.left_out_mfu:>10.1%}{v.left_out_error:>+8.1%}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the rows of this model (or row name) only")
    parser.add_argument("--no-auto", action="store_true", help="compile MaxText's settings only")
    parser.add_argument("--auto-unverified", action="store_true",
                        help="do not compile the automatic plan: its estimate is the formula's")
    parser.add_argument("--maxtext-unverified", action="store_true",
                        help="do not compile MaxText's setting: its estimate is the formula's")
    parser.add_argument("--json", metavar="FILE", help="append one JSON line per compile")
    parser.add_argument("--terms", default=str(DEFAULT_TERMS), metavar="FILE",
                        help="where the compiled programs' cost terms are kept (default: %(default)s)")
    parser.add_argument("--hlo", metavar="DIR", help="also keep each compiled program's HLO text here")
    parser.add_argument("--reread", metavar="DIR", help="recompute the saved terms from the HLO kept in DIR")
    parser.add_argument("--skip-done", action="store_true", help="skip rows whose terms are saved already")
    parser.add_argument("--fit", action="store_true", help="fit the constants on the saved terms; compile nothing")
    args = parser.parse_args()
    if args.reread:
        return reread_rows(args)
    return fit_rows(args) if args.fit else compile_rows(args)


if __name__ == "__main__":
    sys.exit(main())
