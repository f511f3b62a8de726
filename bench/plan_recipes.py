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

Published results outside the fitted file (tests/data/published_mfu_heldout.json) run the same
way with `--rows`; their terms go to tests/data/calibration_terms_heldout.json, and `--check`
prints each row's estimate at the stated constants (FITTED) from those terms, fitting nothing:

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 nohup .venv/bin/python bench/plan_recipes.py \
        --rows tests/data/published_mfu_heldout.json --no-auto > heldout.log 2>&1 &
    .venv/bin/python bench/plan_recipes.py --rows tests/data/published_mfu_heldout.json --check

A recipe that sets weight_dtype or dtype compiles the model with them, as `mxc plan --set
param_dtype=... --set compute_dtype=...` would (mxc's `--maxtext` refuses them otherwise), and a
recipe's custom_mesh, an order of the devices only, with mxc's own order (as `--maxtext` does,
maxtext.DEVICE_ORDER); the printed lines and the saved terms' `compiled_for` say so.

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
DEFAULT_ROWS = ROOT / "tests" / "data" / "published_mfu.json"
DEFAULT_TERMS = ROOT / "tests" / "data" / "calibration_terms.json"
HELDOUT_ROWS = ROOT / "tests" / "data" / "published_mfu_heldout.json"
HELDOUT_TERMS = ROOT / "tests" / "data" / "calibration_terms_heldout.json"
# Where a setting does not fit the real chip's HBM, its program is compiled for this chip (as
# many devices, Google's core-counting name: v5p-512 is 256 chips) to read its costs.
STAND_IN = {"v6e": "v5p", "v5e": "v5p"}
def _terms_for(rows: Path) -> Path:
    """Each rows file keeps its compiled terms in its own file, so that compiling the held-out
    rows never writes into the fitted rows' terms."""
    known = {DEFAULT_ROWS.resolve(): DEFAULT_TERMS, HELDOUT_ROWS.resolve(): HELDOUT_TERMS}
    if rows.resolve() not in known:
        sys.exit(f"--rows {rows}: give --terms FILE too (where its compiled terms are kept)")
    return known[rows.resolve()]


def _load(ref: str, overrides: list[str] = ()):
    """A row's model: a zoo name, or `file.mspec:name` relative to the repository root, with
    `--set` overrides."""
    from mxc.spec.load import load_models

    path, sep, name = ref.rpartition(":")
    if sep and path.endswith(".mspec") and not Path(path).is_absolute():
        ref = f"{ROOT / path}:{name}"
    return next(iter(load_models(ref, overrides).values()))


def _spec_overrides(row: dict) -> list[str]:
    """The `--set` a MaxText user adds to compile a recipe's weight_dtype / dtype, or its model
    without the spec's multi-token prediction (mtp_num_layers 0, MaxText's default): mxc's
    `--maxtext` refuses them unless the spec already agrees (and says to add this), so the bench
    compiles the model as the recipe has it, as that user would."""
    from mxc.compiler.plan.maxtext import SPEC_FIELDS

    spec, params = _load(row["model"]), row["tuning_params"]
    overrides = [f"{field_name}={params[key]}" for key, field_name in SPEC_FIELDS.items()
                 if key in params and str(getattr(spec, field_name)) != str(params[key])]
    if spec.mtp is not None and not params.get("mtp_num_layers", 0):
        overrides.append("mtp=none")
    return overrides


def _changed(row: dict) -> list[str]:
    """How the compiled program departs from the recipe as written: the saved terms' record."""
    from mxc.compiler.plan.maxtext import DEVICE_ORDER

    return [f"--set {o}" for o in _spec_overrides(row)] + [
        f"mxc's device order for {key} {row['tuning_params'][key]}"
        for key in DEVICE_ORDER if key in row["tuning_params"]]


def _estimate_row(label: str, plan) -> dict:
    xla = plan.xla.memory
    lowering = plan.lowering
    return {
        "setting": label, "mesh": plan.mesh_text(), "remat": plan.remat, "microbatches": plan.microbatches,
        "optimizer_state_on_host": bool(lowering and lowering.optimizer_state_on_host),
        "float32_logits_dot": None if lowering is None else lowering.float32_logits_dot,
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
        # Against the published tokens/s: the printed MFUs count FLOPs in more than one way.
        against = (f" (published {published['published_tokens_per_s_per_device']} tokens/s/device, "
                   f"MFU {published['published_mfu']:.1%} as printed; "
                   f"{row['tokens_per_s_per_device'] / published['published_tokens_per_s_per_device'] - 1:+.1%})")
    reason = f": {row['xla_reason']}" if row["xla_status"] != "fits" and row["xla_reason"] else ""
    extras = "".join([
        "; AdamW's moments on host" if row.get("optimizer_state_on_host") else "",
        {True: "; output head in float32", False: "; output head in bfloat16"}.get(row.get("float32_logits_dot"), "")])
    print(f"  {row['setting']:<8} {row['mesh']}; {row['remat']}; {row['microbatches']} mb{extras}\n"
          f"           XLA {row['xla_status']}{reason}, peak {xla}, predicted {row['predicted_gib']:.1f} GiB\n"
          f"           estimate ({row['estimate_from']}): step {row['step_s']:.2f} s, MFU {row['mfu']:.1%}, "
          f"{row['tokens_per_s_per_device']:.0f} tokens/s/device{against}", flush=True)


def compile_rows(args) -> int:
    from mxc.compiler.plan import plan
    from mxc.compiler.plan.calibration import published_rows
    from mxc.compiler.plan.maxtext import plan_setting
    from mxc.compiler.topology import parse

    saved = json.loads(Path(args.terms).read_text()) if args.terms and Path(args.terms).exists() else {}
    for row in published_rows(Path(args.rows)):
        if args.only and args.only not in (row["model"], row["name"]):
            continue
        if args.skip_done and row["name"] in saved:
            continue
        overrides = _spec_overrides(row)
        spec = _load(row["model"], overrides)
        topology = parse(row["topology"], row["slices"])
        print(f"\n{row['name']}: {row['model']} on {row['topology']}"
              + (f" x {row['slices']} slices" if row["slices"] > 1 else "")
              + f", seq {row['seq']}, batch {row['global_batch']} ({row['maxtext_config']})", flush=True)
        if overrides:
            print("  the recipe's model, as mxc is told it: " + " ".join(f"--set {o}" for o in overrides),
                  flush=True)
        terms: list = []
        texts: list = []
        params = dict(row["tuning_params"])
        fixed = plan_setting(spec, topology, params, seq=row["seq"], terms=terms, texts=texts,
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
            (Path(args.hlo) / _hlo_name(row)).write_text(texts[-1])
        if terms and args.terms:
            saved[row["name"]] = {"status": fixed.xla.status, "compiled_for": ", ".join(
                [results[-1]["estimate_from"], *_changed(row)]), "terms": terms[0].to_json()}
            Path(args.terms).write_text(json.dumps(saved, indent=1) + "\n")
        if not args.no_auto:
            # mxc plan's own defaults (attempts, near-tie compiles), so that the row shows the plan
            # `mxc plan` gives: 2 attempts stopped Llama 2 70B on v5p-512 before its third near-tie.
            automatic = plan(spec, topology, seq=row["seq"], batch=row["global_batch"],
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

    saved = json.loads(Path(args.terms).read_text())
    for row in published_rows(Path(args.rows)):
        path = Path(args.reread) / _hlo_name(row)
        if not path.exists():
            continue
        spec, topology = _load(row["model"], _spec_overrides(row)), parse(row["topology"], row["slices"])
        fixed = plan_setting(spec, topology, row["tuning_params"], seq=row["seq"], verify=False)
        time, terms = estimate_from_text(spec, fixed, topology, path.read_text(), plan_mesh(fixed, topology))
        entry = saved.setdefault(row["name"], {"status": "fits", "compiled_for": ", ".join(
            [f"compiled program (HLO from {path.name})", *_changed(row)])})
        entry["terms"] = terms.to_json()
        print(f"{row['name']}: MFU {time.mfu:.1%}, step {time.step_s:.2f} s, {time.tokens_per_s_per_device:.0f} "
              f"tokens/s/device (published {row['published_tokens_per_s_per_device']})")
    Path(args.terms).write_text(json.dumps(saved, indent=1) + "\n")
    return 0


def _hlo_name(row: dict) -> str:
    model = row["model"].rpartition(":")[2] or row["model"]  # a file's model: its name
    return f"{model}_{row['topology']}x{row['slices']}.hlo"


def check_rows(args) -> int:
    """Each row's estimate at the stated constants from its saved terms: the held-out check
    (nothing is fitted on these rows)."""
    from mxc.compiler.plan.calibration import FITTED, calibration_rows

    rows, skipped = calibration_rows(Path(args.terms), Path(args.rows))
    for name, why in skipped:
        print(f"not checked, {name}: {why}")
    print(f"constants: {FITTED}")
    print(f"{'row':<32}{'published':>10}{'estimated':>11}{'error':>8}")
    for row in rows:
        mfu = row.estimate(FITTED)
        print(f"{row.name:<32}{row.published_mfu:>10.1%}{mfu:>11.1%}{mfu / row.published_mfu - 1:>+8.1%}")
    return 0


def fit_rows(args) -> int:
    from mxc.compiler.plan.calibration import FITTED, calibration_rows, leave_one_out

    rows, skipped = calibration_rows(Path(args.terms), Path(args.rows))
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
    parser.add_argument("--rows", default=str(DEFAULT_ROWS), metavar="FILE",
                        help="the published rows (default: %(default)s; the held-out rows: "
                             "tests/data/published_mfu_heldout.json)")
    parser.add_argument("--terms", metavar="FILE",
                        help="where the compiled programs' cost terms are kept (default: the rows file's own, "
                             "calibration_terms.json or calibration_terms_heldout.json)")
    parser.add_argument("--hlo", metavar="DIR", help="also keep each compiled program's HLO text here")
    parser.add_argument("--reread", metavar="DIR", help="recompute the saved terms from the HLO kept in DIR")
    parser.add_argument("--skip-done", action="store_true", help="skip rows whose terms are saved already")
    parser.add_argument("--fit", action="store_true", help="fit the constants on the saved terms; compile nothing")
    parser.add_argument("--check", action="store_true",
                        help="each row's estimate at the stated constants from the saved terms; compile nothing")
    args = parser.parse_args()
    args.terms = args.terms or str(_terms_for(Path(args.rows)))
    if args.check:
        return check_rows(args)
    if args.reread:
        return reread_rows(args)
    return fit_rows(args) if args.fit else compile_rows(args)


if __name__ == "__main__":
    sys.exit(main())
