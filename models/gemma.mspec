# Gemma 1, 2 and 3. All scale the embedding by sqrt(d_model), tie it to the output head, and
# store RMSNorm scales centred on zero (applied as 1 + w). Gemma 2 adds post-norms, soft-capping
# and alternating local/global layers; Gemma 3 drops the caps for QK-norm and runs five local
# layers per global one, with its own RoPE base (and scaling) on the global layers.

model gemma-2b {
  vocab = 256000
  d_model = 2048
  max_seq = 8192
  embedding = embedding(tied = true, scale = sqrt_d_model)
  final_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 18 {
    attention = mqa(heads = 8, head_dim = 256, rope = rope(theta = 10000))
    mlp = glu(hidden = 16384, act = gelu_tanh)
    norm = rmsnorm(eps = 1e-6, zero_centered = true)
  }
}

model gemma-7b extends gemma-2b {
  d_model = 3072
  block x 28 {
    attention = mha(heads = 16, head_dim = 256, rope = rope(theta = 10000))
    mlp.hidden = 24576
  }
}

model gemma2-2b {
  vocab = 256000
  d_model = 2304
  max_seq = 8192
  embedding = embedding(tied = true, scale = sqrt_d_model)
  final_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  final_softcap = 30.0
  param_dtype = float32
  compute_dtype = bfloat16
  block local {
    attention = gqa(heads = 8, kv_heads = 4, head_dim = 256, window = 4096, softcap = 50.0,
                    query_pre_attn_scalar = 256, rope = rope(theta = 10000))
    mlp = glu(hidden = 9216, act = gelu_tanh)
    norm = rmsnorm(eps = 1e-6, zero_centered = true)
    post_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  }
  block global {
    attention = gqa(heads = 8, kv_heads = 4, head_dim = 256, softcap = 50.0,
                    query_pre_attn_scalar = 256, rope = rope(theta = 10000))
    mlp = glu(hidden = 9216, act = gelu_tanh)
    norm = rmsnorm(eps = 1e-6, zero_centered = true)
    post_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  }
  layers = (local, global) x 13
}

model gemma2-9b extends gemma2-2b {
  d_model = 3584
  block local {
    attention.heads = 16
    attention.kv_heads = 8
    mlp.hidden = 14336
  }
  block global {
    attention.heads = 16
    attention.kv_heads = 8
    mlp.hidden = 14336
  }
  layers = (local, global) x 21
}

model gemma2-27b extends gemma2-2b {
  d_model = 4608
  block local {
    attention.heads = 32
    attention.kv_heads = 16
    attention.head_dim = 128
    attention.query_pre_attn_scalar = 144
    mlp.hidden = 36864
  }
  block global {
    attention.heads = 32
    attention.kv_heads = 16
    attention.head_dim = 128
    attention.query_pre_attn_scalar = 144
    mlp.hidden = 36864
  }
  layers = (local, global) x 23
}

model gemma3-1b {
  vocab = 262144
  d_model = 1152
  max_seq = 32768
  embedding = embedding(tied = true, scale = sqrt_d_model)
  final_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  param_dtype = float32
  compute_dtype = bfloat16
  block local {
    attention = mqa(heads = 4, head_dim = 256, window = 512, query_pre_attn_scalar = 256,
                    qk_norm = rmsnorm(eps = 1e-6, zero_centered = true), rope = rope(theta = 10000))
    mlp = glu(hidden = 6912, act = gelu_tanh)
    norm = rmsnorm(eps = 1e-6, zero_centered = true)
    post_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  }
  block global {
    attention = mqa(heads = 4, head_dim = 256, query_pre_attn_scalar = 256,
                    qk_norm = rmsnorm(eps = 1e-6, zero_centered = true),
                    rope = rope(theta = 1000000))
    mlp = glu(hidden = 6912, act = gelu_tanh)
    norm = rmsnorm(eps = 1e-6, zero_centered = true)
    post_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  }
  layers = (local x 5, global) x 4, local x 2
}

# The larger Gemma 3s use a longer window, and linear RoPE scaling (x8) on the global layers.
# Their text halves are the `-text` models; the full models add the SigLIP so400m vision tower.
model gemma3-4b-text extends gemma3-1b {
  vocab = 262208
  d_model = 2560
  max_seq = 131072
  block local {
    attention = gqa(heads = 8, kv_heads = 4, head_dim = 256, window = 1024,
                    query_pre_attn_scalar = 256,
                    qk_norm = rmsnorm(eps = 1e-6, zero_centered = true), rope = rope(theta = 10000))
    mlp.hidden = 10240
  }
  block global {
    attention = gqa(heads = 8, kv_heads = 4, head_dim = 256, query_pre_attn_scalar = 256,
                    qk_norm = rmsnorm(eps = 1e-6, zero_centered = true),
                    rope = rope(theta = 1000000, scaling = linear(factor = 8)))
    mlp.hidden = 10240
  }
  layers = (local x 5, global) x 5, local x 4
}

model gemma3-12b-text extends gemma3-4b-text {
  d_model = 3840
  block local {
    attention.heads = 16
    attention.kv_heads = 8
    mlp.hidden = 15360
  }
  block global {
    attention.heads = 16
    attention.kv_heads = 8
    mlp.hidden = 15360
  }
  layers = (local x 5, global) x 8
}

model gemma3-27b-text extends gemma3-4b-text {
  d_model = 5376
  block local {
    attention.heads = 32
    attention.kv_heads = 16
    attention.head_dim = 128
    attention.query_pre_attn_scalar = 168
    mlp.hidden = 21504
  }
  block global {
    attention.heads = 32
    attention.kv_heads = 16
    attention.head_dim = 128
    attention.query_pre_attn_scalar = 168
    mlp.hidden = 21504
  }
  layers = (local x 5, global) x 10, local x 2
}

# SigLIP so400m at 896 pixels: 64x64 patches of 14 pixels, 27 bidirectional layers; Gemma 3's
# projector average-pools the grid to 16x16 = 256 soft tokens, which replace the 256 image
# placeholders the processor writes between the begin- and end-of-image tokens.
let siglip_so400m = vision(image = 896, d_model = 1152,
                           patches = patches(size = 14, stride = 14, channels = 3),
                           positions = learned(),
                           block = encoder(attention = mha(heads = 16, head_dim = 72, rope = none,
                                                           qkv_bias = true, out_bias = true),
                                           mlp = mlp(hidden = 4304, act = gelu_tanh, bias = true),
                                           norm = layernorm(eps = 1e-6)),
                           layers = 27, final_norm = layernorm(eps = 1e-6),
                           projector = avg_pool(tokens = 256,
                                                norm = rmsnorm(eps = 1e-6, zero_centered = true)),
                           entry = placeholder(token = 262144, begin = 255999, end = 256000,
                                               bidirectional = true))

model gemma3-4b extends gemma3-4b-text {
  vision = siglip_so400m
}

model gemma3-12b extends gemma3-12b-text {
  vision = siglip_so400m
}

model gemma3-27b extends gemma3-27b-text {
  vision = siglip_so400m
}
