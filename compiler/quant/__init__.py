"""Quantization: named configurations (config.py), which parameters a configuration quantizes
(params.py), the quantized and fake-quantized matmuls the lowering calls through
compiler/lower/projection.py (matmul.py) and the int8 KV cache (kv_cache.py). The array
arithmetic itself is runtime/quant_arrays.py, shared with the runtime's quantize-at-load.
docs/quantization.md describes the configurations."""
