# DeepSeek V2 and V3: multi-head latent attention (low-rank, compressed KV with a decoupled RoPE
# head, YaRN-scaled) and fine-grained MoE with shared experts; the first layers stay dense.
# V3 routes with sigmoid scores over expert groups plus a load-balancing correction bias, and
# trains with one multi-token-prediction module. Sizes from each model's HF config.json.

model deepseek2-16b {
  vocab = 102400
  d_model = 2048
  max_seq = 163840
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-6)
  param_dtype = float32
  compute_dtype = bfloat16
  block dense {
    attention = mla(heads = 16, q_lora_rank = none, kv_lora_rank = 512, qk_nope_head_dim = 128,
                    qk_rope_head_dim = 64, v_head_dim = 128, lora_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 10000, interleaved = true,
                                scaling = yarn(factor = 40, original_max_seq = 4096, beta_fast = 32,
                                               beta_slow = 1, mscale = 0.707,
                                               mscale_all_dim = 0.707)))
    mlp = glu(hidden = 10944, act = silu)
    norm = rmsnorm(eps = 1e-6)
  }
  block moe {
    attention = mla(heads = 16, q_lora_rank = none, kv_lora_rank = 512, qk_nope_head_dim = 128,
                    qk_rope_head_dim = 64, v_head_dim = 128, lora_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 10000, interleaved = true,
                                scaling = yarn(factor = 40, original_max_seq = 4096, beta_fast = 32,
                                               beta_slow = 1, mscale = 0.707,
                                               mscale_all_dim = 0.707)))
    mlp = moe(experts = 64, top_k = 6, expert = glu(hidden = 1408, act = silu), shared_experts = 2,
              router = router(score = softmax, normalize = false))
    norm = rmsnorm(eps = 1e-6)
  }
  layers = dense, moe x 26
}

model deepseek2-236b extends deepseek2-16b {
  d_model = 5120
  block dense {
    attention.heads = 128
    attention.q_lora_rank = 1536
    mlp.hidden = 12288
  }
  block moe {
    attention.heads = 128
    attention.q_lora_rank = 1536
    mlp = moe(experts = 160, top_k = 6, expert = glu(hidden = 1536, act = silu), shared_experts = 2,
              router = router(score = softmax, normalize = false, groups = 8, top_groups = 3,
                              routed_scale = 16.0))
  }
  layers = dense, moe x 59
}

model deepseek3-671b {
  vocab = 129280
  d_model = 7168
  max_seq = 163840
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-6)
  param_dtype = float32
  compute_dtype = bfloat16
  block dense {
    attention = mla(heads = 128, q_lora_rank = 1536, kv_lora_rank = 512, qk_nope_head_dim = 128,
                    qk_rope_head_dim = 64, v_head_dim = 128, lora_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 10000, interleaved = true,
                                scaling = yarn(factor = 40, original_max_seq = 4096, beta_fast = 32,
                                               beta_slow = 1, mscale = 1.0, mscale_all_dim = 1.0)))
    mlp = glu(hidden = 18432, act = silu)
    norm = rmsnorm(eps = 1e-6)
  }
  block moe {
    attention = mla(heads = 128, q_lora_rank = 1536, kv_lora_rank = 512, qk_nope_head_dim = 128,
                    qk_rope_head_dim = 64, v_head_dim = 128, lora_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 10000, interleaved = true,
                                scaling = yarn(factor = 40, original_max_seq = 4096, beta_fast = 32,
                                               beta_slow = 1, mscale = 1.0, mscale_all_dim = 1.0)))
    mlp = moe(experts = 256, top_k = 8, expert = glu(hidden = 2048, act = silu), shared_experts = 1,
              router = router(score = sigmoid, normalize = true, groups = 8, top_groups = 4,
                              correction_bias = true, routed_scale = 2.5))
    norm = rmsnorm(eps = 1e-6)
  }
  layers = dense x 3, moe x 58
  mtp = mtp(depth = 1, block = moe, loss_weight = 0.3)
}

# A tiny DeepSeek V3 for tests: MLA with a low-rank query, grouped sigmoid routing, shared
# expert, a dense first layer and one MTP module.
model mla-tiny extends deepseek3-671b {
  vocab = 512
  d_model = 64
  max_seq = 256
  block dense {
    attention = mla(heads = 4, q_lora_rank = 32, kv_lora_rank = 32, qk_nope_head_dim = 16,
                    qk_rope_head_dim = 8, v_head_dim = 16, lora_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 10000, interleaved = true,
                                scaling = yarn(factor = 4, original_max_seq = 64, beta_fast = 32,
                                               beta_slow = 1, mscale = 1.0, mscale_all_dim = 1.0)))
    mlp.hidden = 128
  }
  block moe {
    attention = mla(heads = 4, q_lora_rank = 32, kv_lora_rank = 32, qk_nope_head_dim = 16,
                    qk_rope_head_dim = 8, v_head_dim = 16, lora_norm = rmsnorm(eps = 1e-6),
                    rope = rope(theta = 10000, interleaved = true,
                                scaling = yarn(factor = 4, original_max_seq = 64, beta_fast = 32,
                                               beta_slow = 1, mscale = 1.0, mscale_all_dim = 1.0)))
    mlp = moe(experts = 8, top_k = 2, expert = glu(hidden = 32, act = silu), shared_experts = 1,
              router = router(score = sigmoid, normalize = true, groups = 4, top_groups = 2,
                              correction_bias = true, routed_scale = 2.5))
  }
  layers = dense, moe x 2
}

# DeepSeek R1: the V3 architecture (reasoning-trained weights).
model deepseek-r1 extends deepseek3-671b {}
