# Qwen3 dense and MoE: GQA with QK-norm (RMSNorm over head_dim), SwiGLU, RoPE base 1e6.
# Sizes from each model's HF config.json.

model qwen3-0.6b {
  vocab = 151936
  d_model = 1024
  max_seq = 40960
  embedding = embedding(tied = true)
  final_norm = rmsnorm(eps = 1e-6)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 28 {
    attention = gqa(heads = 16, kv_heads = 8, head_dim = 128, qk_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 1000000))
    mlp = glu(hidden = 3072, act = silu)
    norm = rmsnorm(eps = 1e-6)
  }
}

model qwen3-1.7b extends qwen3-0.6b {
  d_model = 2048
  block x 28 {
    mlp.hidden = 6144
  }
}

model qwen3-4b extends qwen3-0.6b {
  d_model = 2560
  block x 36 {
    attention.heads = 32
    mlp.hidden = 9728
  }
}

model qwen3-8b extends qwen3-0.6b {
  d_model = 4096
  embedding.tied = false
  block x 36 {
    attention.heads = 32
    mlp.hidden = 12288
  }
}

model qwen3-14b extends qwen3-8b {
  d_model = 5120
  block x 40 {
    attention.heads = 40
    mlp.hidden = 17408
  }
}

model qwen3-32b extends qwen3-8b {
  d_model = 5120
  block x 64 {
    attention.heads = 64
    mlp.hidden = 25600
  }
}

# Qwen3-MoE: every layer routes to 8 of 128 experts, softmax with renormalised top-k.
model qwen3-30b-a3b {
  vocab = 151936
  d_model = 2048
  max_seq = 40960
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-6)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 48 {
    attention = gqa(heads = 32, kv_heads = 4, head_dim = 128, qk_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 1000000))
    mlp = moe(experts = 128, top_k = 8, expert = glu(hidden = 768, act = silu),
              router = router(score = softmax, normalize = true))
    norm = rmsnorm(eps = 1e-6)
  }
}

model qwen3-235b-a22b extends qwen3-30b-a3b {
  d_model = 4096
  block x 94 {
    attention.heads = 64
    mlp.expert.hidden = 1536
  }
}

# Qwen3-Coder 480B-A35B: 62 layers routing to 8 of 160 experts, RoPE base 1e7 over 256K tokens.
model qwen3-coder-480b-a35b extends qwen3-30b-a3b {
  d_model = 6144
  max_seq = 262144
  block x 62 {
    attention = gqa(heads = 96, kv_heads = 8, head_dim = 128, qk_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 10000000))
    mlp.experts = 160
    mlp.expert.hidden = 2560
  }
}
