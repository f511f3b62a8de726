# Llama 2, Llama 3.1 and Llama 3.2: dense decoders with GQA (MHA for the smaller Llama 2s),
# a SwiGLU feed-forward and pre-RMSNorm. Sizes from each model's HF config.json.

model llama2-7b {
  vocab = 32000
  d_model = 4096
  max_seq = 4096
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 32 {
    attention = mha(heads = 32, head_dim = 128, rope = rope(theta = 10000))
    mlp = glu(hidden = 11008, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}

model llama2-13b extends llama2-7b {
  d_model = 5120
  block x 40 {
    attention.heads = 40
    mlp.hidden = 13824
  }
}

model llama2-70b extends llama2-7b {
  d_model = 8192
  block x 80 {
    attention = gqa(heads = 64, kv_heads = 8, head_dim = 128, rope = rope(theta = 10000))
    mlp.hidden = 28672
  }
}

model llama3.1-8b {
  vocab = 128256
  d_model = 4096
  max_seq = 131072
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 32 {
    attention = gqa(heads = 32, kv_heads = 8, head_dim = 128,
                    rope = rope(theta = 500000,
                                scaling = llama3(factor = 8, low_freq = 1, high_freq = 4,
                                                 original_max_seq = 8192)))
    mlp = glu(hidden = 14336, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}

model llama3.1-70b extends llama3.1-8b {
  d_model = 8192
  block x 80 {
    attention.heads = 64
    mlp.hidden = 28672
  }
}

model llama3.1-405b extends llama3.1-8b {
  d_model = 16384
  block x 126 {
    attention.heads = 128
    mlp.hidden = 53248
  }
}

model llama3.2-1b extends llama3.1-8b {
  d_model = 2048
  embedding.tied = true
  block x 16 {
    attention.head_dim = 64
    attention.rope.scaling.factor = 32
    mlp.hidden = 8192
  }
}

model llama3.2-3b extends llama3.1-8b {
  d_model = 3072
  embedding.tied = true
  block x 28 {
    attention.heads = 24
    attention.rope.scaling.factor = 32
    mlp.hidden = 8192
  }
}

# A tiny Llama 3 for tests and the quick-start: byte-level vocabulary plus room for specials.
model llama3-tiny extends llama3.1-8b {
  vocab = 512
  d_model = 64
  max_seq = 256
  block x 2 {
    attention.heads = 4
    attention.kv_heads = 2
    attention.head_dim = 16
    mlp.hidden = 128
  }
}

# Llama 3 (April 2024): Llama 3.1's shapes with plain RoPE (no llama3 scaling) over 8K tokens.
model llama3-8b extends llama3.1-8b {
  max_seq = 8192
  block x 32 {
    attention.rope = rope(theta = 500000)
  }
}

model llama3-70b extends llama3-8b {
  d_model = 8192
  block x 80 {
    attention.heads = 64
    mlp.hidden = 28672
  }
}

# Llama 3.3 70B: Llama 3.1 70B's architecture (new weights).
model llama3.3-70b extends llama3.1-70b {}

# Llama 3.2 Vision: Llama 3.1's text model with a cross-attention layer every fifth layer (3, 8,
# ..., from 0), whose keys and values are the projected image features; the input table has 8
# rows past the vocabulary (the image token 128256 among them). The tower cuts an image into up to
# four 560-pixel tiles; 32 local layers (layers 3, 7, 15, 23, 30 kept) and 8 gated global layers,
# then one matrix from 5 x 1280 + 1280 features per token to d_model.
let mllama_vision = vision(image = 560, d_model = 1280,
                           patches = patches(size = 14, stride = 14, channels = 3, bias = false),
                           positions = learned(),
                           block = encoder(attention = mha(heads = 16, head_dim = 80, rope = none),
                                           mlp = mlp(hidden = 5120, act = gelu, bias = true),
                                           norm = layernorm(eps = 1e-5)),
                           layers = 32, final_norm = layernorm(eps = 1e-5), projector = linear(),
                           entry = cross_attention(token = 128256), class_token = true,
                           pre_norm = layernorm(eps = 1e-5),
                           tiles = tiles(max = 4, aspect_ratios = 8), global_layers = 8,
                           intermediate = [3, 7, 15, 23, 30])

model llama3.2-11b-vision {
  vocab = 128256
  d_model = 4096
  max_seq = 131072
  embedding = embedding(tied = false, extra_rows = 8)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = bfloat16
  block dense {
    attention = gqa(heads = 32, kv_heads = 8, head_dim = 128,
                    rope = rope(theta = 500000,
                                scaling = llama3(factor = 8, low_freq = 1, high_freq = 4,
                                                 original_max_seq = 8192)))
    mlp = glu(hidden = 14336, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  block cross {
    attention = cross_attention(heads = 32, kv_heads = 8, head_dim = 128,
                                qk_norm = rmsnorm(eps = 1e-5))
    mlp = glu(hidden = 14336, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  layers = dense x 3, (cross, dense x 4) x 7, cross, dense
  vision = mllama_vision
}

model llama3.2-90b-vision extends llama3.2-11b-vision {
  d_model = 8192
  block dense {
    attention.heads = 64
    mlp.hidden = 28672
  }
  block cross {
    attention.heads = 64
    mlp.hidden = 28672
  }
  layers = dense x 3, (cross, dense x 4) x 19, cross, dense
}
