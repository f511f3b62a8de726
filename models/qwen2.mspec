# Qwen2.5 dense: GQA with biases on the query, key and value projections (none on the output),
# SwiGLU, RoPE base 1e6. Sizes from each base model's HF config.json (use_sliding_window is
# false: every layer attends to the whole prefix).

model qwen2.5-7b {
  vocab = 152064
  d_model = 3584
  max_seq = 131072
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-6)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 28 {
    attention = gqa(heads = 28, kv_heads = 4, head_dim = 128, qkv_bias = true,
                    rope = rope(theta = 1000000))
    mlp = glu(hidden = 18944, act = silu)
    norm = rmsnorm(eps = 1e-6)
  }
}

model qwen2.5-72b extends qwen2.5-7b {
  d_model = 8192
  final_norm = rmsnorm(eps = 1e-5)
  block x 80 {
    attention.heads = 64
    attention.kv_heads = 8
    mlp.hidden = 29568
    norm = rmsnorm(eps = 1e-5)
  }
}
