# Llama 4 (text): every fourth layer is a global NoPE layer (no RoPE, query temperature tuning);
# the others use RoPE with QK-norm (an L2 norm without scale) and chunked local attention
# (8192). Experts: top-1 with sigmoid scores applied to the expert's input, plus one shared
# expert. Scout routes on every layer; Maverick alternates dense and MoE layers.
# Sizes from each model's HF config.json (text_config). The text halves are the `-text` models;
# the full models add the vision tower (vision_config) below.

model llama4-17b-16e-text {
  vocab = 202048
  d_model = 5120
  max_seq = 10485760
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = bfloat16
  block rope_moe {
    attention = gqa(heads = 40, kv_heads = 8, head_dim = 128, chunk = 8192,
                    qk_norm = rmsnorm(eps = 1e-5, scale = false),
                    rope = rope(theta = 500000, interleaved = true,
                                scaling = llama3(factor = 16, low_freq = 1, high_freq = 1,
                                                 original_max_seq = 8192)))
    mlp = moe(experts = 16, top_k = 1, expert = glu(hidden = 8192, act = silu), shared_experts = 1,
              router = router(score = sigmoid, normalize = false, weight_on = input))
    norm = rmsnorm(eps = 1e-5)
  }
  block nope_moe {
    attention = gqa(heads = 40, kv_heads = 8, head_dim = 128, rope = none,
                    temperature_tuning = temperature_tuning(floor_scale = 8192, attn_scale = 0.1))
    mlp = moe(experts = 16, top_k = 1, expert = glu(hidden = 8192, act = silu), shared_experts = 1,
              router = router(score = sigmoid, normalize = false, weight_on = input))
    norm = rmsnorm(eps = 1e-5)
  }
  layers = (rope_moe x 3, nope_moe) x 12
}

# Maverick: 128 experts on odd layers, dense SwiGLU (16384) on even ones; no QK-norm.
model llama4-17b-128e-text {
  vocab = 202048
  d_model = 5120
  max_seq = 1048576
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = bfloat16
  block rope_dense {
    attention = gqa(heads = 40, kv_heads = 8, head_dim = 128, chunk = 8192,
                    rope = rope(theta = 500000, interleaved = true))
    mlp = glu(hidden = 16384, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  block rope_moe {
    attention = gqa(heads = 40, kv_heads = 8, head_dim = 128, chunk = 8192,
                    rope = rope(theta = 500000, interleaved = true))
    mlp = moe(experts = 128, top_k = 1, expert = glu(hidden = 8192, act = silu), shared_experts = 1,
              router = router(score = sigmoid, normalize = false, weight_on = input))
    norm = rmsnorm(eps = 1e-5)
  }
  block nope_moe {
    attention = gqa(heads = 40, kv_heads = 8, head_dim = 128, rope = none,
                    temperature_tuning = temperature_tuning(floor_scale = 8192, attn_scale = 0.1))
    mlp = moe(experts = 128, top_k = 1, expert = glu(hidden = 8192, act = silu), shared_experts = 1,
              router = router(score = sigmoid, normalize = false, weight_on = input))
    norm = rmsnorm(eps = 1e-5)
  }
  layers = (rope_dense, rope_moe, rope_dense, nope_moe) x 12
}

# Both models' vision tower: 336-pixel images in 24x24 patches of 14 pixels and a class token,
# 34 bidirectional layers with a 2D RoPE; the pixel shuffle folds 2x2 patches into one token, so
# 144 soft tokens per image replace the placeholders between the begin- and end-of-image tokens.
let llama4_vision = vision(image = 336, d_model = 1408,
                           patches = patches(size = 14, stride = 14, channels = 3, bias = false),
                           positions = learned(),
                           block = encoder(attention = mha(heads = 16, head_dim = 88, rope = none,
                                                           qkv_bias = true, out_bias = true),
                                           mlp = mlp(hidden = 5632, act = gelu, bias = true),
                                           norm = layernorm(eps = 1e-5)),
                           layers = 34, final_norm = layernorm(eps = 1e-5),
                           projector = pixel_shuffle(ratio = 0.5, adapter = 4096),
                           entry = placeholder(token = 200092, begin = 200080, end = 200081),
                           class_token = true, pre_norm = layernorm(eps = 1e-5),
                           rope = rope_2d(theta = 10000))

model llama4-17b-16e extends llama4-17b-16e-text {
  vision = llama4_vision
}

model llama4-17b-128e extends llama4-17b-128e-text {
  vision = llama4_vision
}
