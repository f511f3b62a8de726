# MaxText's synthetic models of its December 2023 v5p and v5e scaling tables, for the held-out
# calibration rows (tests/data/published_mfu_heldout.json). MaxText builds them from
# MaxText/configs/base.yml and `global_parameter_scale` (AI-Hypercomputer/maxtext at 76bd53b0f,
# MaxText/pyconfig.py, get_individual_scales): with log2(scale) = 3 b + r, the heads and the MLP
# width double b + (r > 0) times, the embedding b + (r > 1) times, the layers b times, from
# base_emb_dim 2560, base_num_heads 8, base_mlp_dim 8192, base_num_decoder_layers 16; head_dim 256,
# vocab_size 32768, mlp_activations ["relu"] (one input matrix), logits_via_embedding (tied),
# RoPE (LLaMARotaryEmbedding, its default theta 10000), RMSNorm, every head its own keys and values.
#
# MaxText's layer of that commit (MaxText/layers/models.py, DecoderLayer) is a parallel block:
# one RMSNorm of the input, which attention and the MLP both read, and their sum (dropout off)
# joins the residual: `parallel = true`.

model maxtext-16b {
  vocab = 32768
  d_model = 5120
  max_seq = 2048
  embedding = embedding(tied = true)
  final_norm = rmsnorm(eps = 1e-6)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 32 {
    attention = mha(heads = 32, head_dim = 256, rope = rope(theta = 10000))
    mlp = mlp(hidden = 32768, act = relu)
    norm = rmsnorm(eps = 1e-6)
    parallel = true
  }
}

model maxtext-32b extends maxtext-16b {
  d_model = 10240
}

model maxtext-64b extends maxtext-16b {
  d_model = 10240
  block x 64 { }
}

model maxtext-128b extends maxtext-16b {
  d_model = 10240
  block x 64 {
    attention.heads = 64
    mlp.hidden = 65536
  }
}
