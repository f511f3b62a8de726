# Models of published MaxText recipes whose MaxText config differs from the zoo's model of that
# name, for the held-out calibration rows (tests/data/published_mfu_heldout.json).
#
# mistral-7b: MaxText's MaxText/configs/models/mistral-7b.yml (AI-Hypercomputer/maxtext tag
# tpu-recipes-v0.1.2) has no sliding window and RoPE max timescale 1,000,000 (Mistral 7B v0.2's
# shape); the zoo's mistral-7b (models/mistral.mspec) is v0.1, with a 4096-token window and theta
# 10000. Otherwise the same: emb 4096, 32 query and 8 key-value heads of 128, MLP 14336 (SiLU GLU),
# 32 layers, vocab 32000, RMSNorm eps 1e-5, untied head (logits_via_embedding false).

model mistral-7b {
  vocab = 32000
  d_model = 4096
  max_seq = 32768
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 32 {
    attention = gqa(heads = 32, kv_heads = 8, head_dim = 128, rope = rope(theta = 1000000))
    mlp = glu(hidden = 14336, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}
