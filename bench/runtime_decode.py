"""Time to first token and decode speed at batch 1: `mxc generate` with an artifact's precompiled
prefill and decode, against HuggingFace transformers' `generate` on the same weights, on this
machine's CPU.

A Llama (a preset of runtime_common.MODELS) is initialised randomly in transformers (seeded),
saved as a HF checkpoint, imported with `mxc import-hf` (float32), and compiled with `--serve`
for batch 1. Both sides decode the same prompt greedily in float32; their tokens must agree.
mxc's figures come from its own report (time to first token: request start to the first new
token on the host, prefill included; decode tokens/s per user after it), one fresh `mxc
generate` process per round. transformers' time to first token is one `generate` of one new
token, its decode rate (N - 1) / (time for N new tokens - time for 1), warm. The sides alternate
for `--rounds` rounds; the ratios are those of the medians.

    .venv/bin/python bench/runtime_decode.py [--model llama-20m] [--prompt 128] [--new 128]
        [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runtime_common import MODELS, MXC, PYTHON, BenchModel, cpu_env, machine, run  # noqa: E402


def make_hf_model(model: BenchModel, directory: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**model.hf_config())).eval()
    hf.save_pretrained(directory, safe_serialization=True)
    return hf


def hf_generate(model, prompt, new: int):
    import torch

    with torch.no_grad():
        return model.generate(torch.as_tensor(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              use_cache=True, pad_token_id=0)


def hf_round(model, prompt, new: int) -> dict:
    started = time.perf_counter()
    hf_generate(model, prompt, 1)
    first = time.perf_counter() - started
    started = time.perf_counter()
    output = hf_generate(model, prompt, new)
    whole = time.perf_counter() - started
    return {"time_to_first_token_s": first, "decode_tokens_per_second_per_user": (new - 1) / (whole - first),
            "tokens": output.numpy()}


def mxc_build(work: Path, prompt_len: int, new: int) -> float:
    run([MXC, "import-hf", str(work / "hf"), "-o", str(work / "model")])
    started = time.perf_counter()
    run([MXC, "compile", str(work / "model" / "model.mspec"), "--topology", "local", "--seq", str(prompt_len),
         "--batch", "1", "--serve", "--serve-batch", "1", "--prompt-len", str(prompt_len),
         "--cache-len", str(prompt_len + new), "-o", str(work / "artifact"), "--force"])
    return time.perf_counter() - started


def mxc_round(work: Path, new: int) -> dict:
    import numpy as np

    report = work / "report.json"
    run([PYTHON, "-m", "mxc.runtime", "generate", str(work / "artifact"), "--params", str(work / "model" / "params"),
         "--prompt-tokens", str(work / "prompt.npy"), "--max-new", str(new), "--greedy",
         "-o", str(work / "mxc_tokens.npy"), "--report", str(report)])
    timings = json.loads(report.read_text())
    return {"time_to_first_token_s": timings["time_to_first_token_s"],
            "decode_tokens_per_second_per_user": timings["decode_tokens_per_second_per_user"],
            "tokens": np.load(work / "mxc_tokens.npy")}


def medians(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 4)
            for key in ("time_to_first_token_s", "decode_tokens_per_second_per_user")}


def main() -> None:
    import numpy as np
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-20m")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="new tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.update(cpu_env())
    torch.set_num_threads(os.cpu_count() or 1)
    model = MODELS[args.model]
    work = Path(args.work or tempfile.mkdtemp(prefix="mxc-bench-decode-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = make_hf_model(model, work / "hf")
    prompt = np.random.default_rng(0).integers(0, model.vocab, size=(1, args.prompt)).astype(np.int32)
    np.save(work / "prompt.npy", prompt)
    compile_seconds = mxc_build(work, args.prompt, args.new)
    hf_generate(hf, prompt, 2)  # warm-up
    mxc_runs, hf_runs = [], []
    for _ in range(args.rounds):  # interleaved, so a busy moment of the machine hits both sides
        mxc_runs.append(mxc_round(work, args.new))
        hf_runs.append(hf_round(hf, prompt, args.new))
        print(f"mxc {medians(mxc_runs[-1:])}; transformers {medians(hf_runs[-1:])}", file=sys.stderr)
    same = all(np.array_equal(m["tokens"], h["tokens"]) for m, h in zip(mxc_runs, hf_runs))
    mxc, transformers = medians(mxc_runs), medians(hf_runs)
    result = {"model": f"{args.model} ({model.parameters() / 1e6:.1f}M parameters, float32)", "batch": 1,
              "prompt_tokens": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
              "mxc": {**mxc, "compile_seconds": round(compile_seconds, 1)}, "transformers": transformers,
              "same_greedy_tokens": same,
              "ttft_mxc_over_transformers": round(mxc["time_to_first_token_s"]
                                                  / transformers["time_to_first_token_s"], 2),
              "decode_mxc_over_transformers": round(mxc["decode_tokens_per_second_per_user"]
                                                    / transformers["decode_tokens_per_second_per_user"], 2),
              "machine": machine()}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
