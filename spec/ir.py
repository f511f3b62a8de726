"""The typed IR: the single source of truth that analysis and lowering read.

Every "kind" is a discriminated union on the field `kind`, spelled in .mspec as a call:
`attention = gqa(heads = 32, ...)` is `{"kind": "gqa", "heads": 32, ...}`. Defaults exist only
where the reference architectures agree; everything else must be stated.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from mxc.records import omit_at_default

LOGICAL_AXES = ("batch", "seq", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp",
                "experts", "layers", "q_lora", "kv_lora", "cache_seq", "residual_seq")
MESH_AXES = ("data", "fsdp", "tensor", "expert", "context", "stage")

LogicalAxis = Literal["batch", "seq", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp",
                      "experts", "layers", "q_lora", "kv_lora", "cache_seq", "residual_seq"]
MeshAxis = Literal["data", "fsdp", "tensor", "expert", "context", "stage"]
DType = Literal["float32", "bfloat16", "float16"]
Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]


def _quantization_name(name: str) -> str:
    from mxc.compiler.quant.config import parse  # plain Python, no JAX

    return parse(name).name


# A serving precision a model ships with (docs/quantization.md), e.g. "int8" or "int8+int8-kv".
QuantizationName = Annotated[str, AfterValidator(_quantization_name)]


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------- norms

class RMSNorm(Node):
    kind: Literal["rmsnorm"] = "rmsnorm"
    eps: PositiveFloat
    # Gemma stores the scale centred on zero and multiplies by (1 + w).
    zero_centered: bool = False
    # Llama 4's QK-norm has no learnable scale (an L2 norm over head_dim).
    scale: bool = True


class LayerNorm(Node):
    kind: Literal["layernorm"] = "layernorm"
    eps: PositiveFloat
    bias: bool = True


Norm = Annotated[Union[RMSNorm, LayerNorm], Field(discriminator="kind")]


# ---------------------------------------------------------------- positions

class LinearScaling(Node):
    kind: Literal["linear"] = "linear"
    factor: PositiveFloat


class Llama3Scaling(Node):
    kind: Literal["llama3"] = "llama3"
    factor: PositiveFloat
    low_freq: PositiveFloat  # low_freq_factor
    high_freq: PositiveFloat  # high_freq_factor
    original_max_seq: PositiveInt


class YarnScaling(Node):
    kind: Literal["yarn"] = "yarn"
    factor: PositiveFloat
    original_max_seq: PositiveInt
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    # DeepSeek's attention-scale terms; 1.0/0.0 reduce to the YaRN paper's 0.1·ln(s)+1.
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # GPT-OSS keeps the correction range unrounded.
    truncate: bool = True


class LongRopeScaling(Node):
    """LongRoPE (Phi-3, Phi-3.5): each rotary frequency divided by its own factor, from the short
    list while a sequence fits original_max_seq and from the long list once it is longer; cos and
    sin are scaled by attention_factor, by default sqrt(1 + ln(factor) / ln(original_max_seq))."""

    kind: Literal["longrope"] = "longrope"
    short_factor: tuple[PositiveFloat, ...]  # one per rotary pair: head_dim / 2 values
    long_factor: tuple[PositiveFloat, ...]
    original_max_seq: PositiveInt
    factor: PositiveFloat  # the context extension, max_seq / original_max_seq in Phi-3's configs
    attention_factor: PositiveFloat | None = None


RopeScaling = Annotated[Union[LinearScaling, Llama3Scaling, YarnScaling, LongRopeScaling],
                        Field(discriminator="kind")]


class Rope(Node):
    kind: Literal["rope"] = "rope"
    theta: PositiveFloat
    scaling: RopeScaling | None = None
    # Rotate adjacent pairs (complex form, as Llama 4 and DeepSeek's originals) instead of halves.
    interleaved: bool = False


class TemperatureTuning(Node):
    """Llama 4's query scaling on NoPE layers: 1 + attn_scale·log(floor((pos+1)/floor_scale)+1)."""

    kind: Literal["temperature_tuning"] = "temperature_tuning"
    floor_scale: PositiveFloat
    attn_scale: PositiveFloat


# ---------------------------------------------------------------- attention

class _AttentionCommon(Node):
    heads: PositiveInt
    rope: Rope | None  # None: no positional encoding on this layer (NoPE)
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: Norm | None = None
    softcap: PositiveFloat | None = None
    window: PositiveInt | None = None  # sliding window, in tokens (the query's own included)
    chunk: PositiveInt | None = None  # chunked local attention (Llama 4), in tokens
    sinks: bool = False  # a learned per-head logit in the softmax's denominator (GPT-OSS)
    # Scores are scaled by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5 (Gemma 2/3).
    query_pre_attn_scalar: PositiveFloat | None = None
    temperature_tuning: TemperatureTuning | None = None


class MHA(_AttentionCommon):
    kind: Literal["mha"] = "mha"
    head_dim: PositiveInt

    @property
    def kv_heads(self) -> int:
        return self.heads


class GQA(_AttentionCommon):
    kind: Literal["gqa"] = "gqa"
    kv_heads: PositiveInt
    head_dim: PositiveInt


class MQA(_AttentionCommon):
    kind: Literal["mqa"] = "mqa"
    head_dim: PositiveInt

    @property
    def kv_heads(self) -> int:
        return 1


class MLA(_AttentionCommon):
    """Multi-head latent attention (DeepSeek V2/V3)."""

    kind: Literal["mla"] = "mla"
    q_lora_rank: PositiveInt | None  # None: a full-rank query projection (V2-Lite)
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt
    lora_norm: Norm  # on the compressed q and kv latents

    @property
    def kv_heads(self) -> int:
        return self.heads

    @property
    def head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class CrossAttention(_AttentionCommon):
    """Llama 3.2 Vision: the layer's queries come from the text, its keys and values from the
    projected image features (the tower's entry is cross_attention), each head's queries and keys
    normalised by `qk_norm`; no positions. With `gated`, the block's attention and feed-forward
    outputs are each scaled by tanh of a learned scalar before they join the residual, and the
    feed-forward's by 0 on a text row that sees no image."""

    kind: Literal["cross_attention"] = "cross_attention"
    kv_heads: PositiveInt
    head_dim: PositiveInt
    rope: None = None
    gated: bool = True


Attention = Annotated[Union[MHA, GQA, MQA, MLA, CrossAttention], Field(discriminator="kind")]


# ---------------------------------------------------------------- feed-forward

class MLP(Node):
    """Two matrices with an activation between them (GPT-2, Gemma's original MLP)."""

    kind: Literal["mlp"] = "mlp"
    hidden: PositiveInt
    act: Activation
    bias: bool = False


class GLU(Node):
    """Gated linear unit: down(act(gate(x)) * up(x))."""

    kind: Literal["glu"] = "glu"
    hidden: PositiveInt
    act: Activation
    bias: bool = False


class ClampedSwiGLU(Node):
    """GPT-OSS: gate clamped above, up clamped both ways, gate·sigmoid(alpha·gate)·(up + 1)."""

    kind: Literal["clamped_swiglu"] = "clamped_swiglu"
    hidden: PositiveInt
    alpha: PositiveFloat
    limit: PositiveFloat
    bias: bool = True


DenseFFN = Annotated[Union[MLP, GLU, ClampedSwiGLU], Field(discriminator="kind")]


class Router(Node):
    kind: Literal["router"] = "router"
    score: Literal["softmax", "sigmoid"]
    # Top-k renormalised to sum to one (Mixtral, Qwen3-MoE, DeepSeek V3, GPT-OSS).
    normalize: bool
    groups: PositiveInt = 1  # experts are split into groups ...
    top_groups: PositiveInt = 1  # ... and tokens route only within the best groups
    correction_bias: bool = False  # DeepSeek V3's load-balancing bias, added for selection only
    routed_scale: PositiveFloat = 1.0  # routed_scaling_factor
    bias: bool = False  # a bias on the router's projection (GPT-OSS)
    # Llama 4 scales the expert's input by the router weight instead of its output.
    weight_on: Literal["output", "input"] = "output"


class MoE(Node):
    kind: Literal["moe"] = "moe"
    experts: PositiveInt
    top_k: PositiveInt
    expert: DenseFFN  # one routed expert
    shared_experts: int = Field(default=0, ge=0)  # each shaped like `expert`
    router: Router


FFN = Annotated[Union[MLP, GLU, ClampedSwiGLU, MoE], Field(discriminator="kind")]


# ---------------------------------------------------------------- blocks and the model

class Block(Node):
    """One decoder layer kind: pre-norm attention then pre-norm feed-forward, with residuals."""

    attention: Attention
    mlp: FFN
    norm: Norm
    # Gemma 2/3 also normalise each sub-layer's output before it joins the residual.
    post_norm: Norm | None = None
    # A parallel block (GPT-J, PaLM, Falcon, MaxText's 2023 layer): one norm of the input, which
    # attention and the feed-forward both read; both outputs join the residual together.
    parallel: bool = False

    _omit = omit_at_default("parallel")


class Segment(Node):
    """`period` (a tuple of block names) run `repeat` times: one lax.scan over the repeats."""

    period: tuple[str, ...]
    repeat: PositiveInt


class Embedding(Node):
    kind: Literal["embedding"] = "embedding"
    tied: bool  # the output head reuses the embedding matrix
    scale: Literal["none", "sqrt_d_model"] = "none"  # Gemma multiplies by sqrt(d_model)
    # Rows beyond the vocabulary that only the input table has (Llama 3.2 Vision: 8, its image
    # token among them); the output head keeps `vocab`.
    extra_rows: int = Field(default=0, ge=0)

    _omit = omit_at_default("extra_rows")


class MTP(Node):
    """DeepSeek V3's multi-token prediction modules, used in training only."""

    kind: Literal["mtp"] = "mtp"
    depth: PositiveInt
    block: str  # the block kind each module runs
    loss_weight: PositiveFloat


# ---------------------------------------------------------------- vision towers
# A tower turns an image into embeddings the text model reads: patches, positions, an encoder of
# `layers` blocks (the same attention/feed-forward/norm kinds as the text model; every patch sees
# every other), a final norm, a projector to the text model's d_model, and an entry saying where
# the projected tokens go in the text. Further position, projector and entry kinds (2D RoPE, pixel
# shuffle with an adapter MLP, cross-attention layers) join the unions below.

class Patches(Node):
    """Square patches cut from the image and projected to the tower's width (a convolution with
    kernel `size` and `stride`, as SigLIP and ViT write it)."""

    kind: Literal["patches"] = "patches"
    size: PositiveInt  # pixels per patch side
    stride: PositiveInt  # pixels between patch starts; equal to size for non-overlapping patches
    channels: PositiveInt = 3
    bias: bool = True


class LearnedPositions(Node):
    """One learned vector per patch position, added to the patch embeddings (SigLIP, ViT)."""

    kind: Literal["learned"] = "learned"


VisionPositions = LearnedPositions  # a union (discriminated on kind) once a second kind joins


class AxialRope(Node):
    """2D RoPE over the patch grid on every encoder layer's queries and keys (Llama 4, the axial
    RoPE Pixtral also uses): in each head, the first half of the adjacent dimension pairs turn with
    the patch's column, the second half with its row (both counted from 1), over the same
    head_dim / 4 frequencies of `theta`; a class token is not turned."""

    kind: Literal["rope_2d"] = "rope_2d"
    theta: PositiveFloat


class EncoderBlock(Block):
    """One vision encoder layer: a pre-norm block whose attention is bidirectional over the image."""

    kind: Literal["encoder"] = "encoder"


class PooledProjector(Node):
    """Gemma 3: the patch grid average-pooled to `tokens` soft tokens (a square grid), normalised,
    then projected linearly to the text model's d_model."""

    kind: Literal["avg_pool"] = "avg_pool"
    tokens: PositiveInt  # soft tokens per image (mm_tokens_per_image)
    norm: Norm
    bias: bool = False


class PixelShuffleProjector(Node):
    """Llama 4: a pixel shuffle folds each (1/ratio) x (1/ratio) square of the patch grid into one
    token of width / ratio², an adapter MLP (two bias-free matrices `adapter` wide, `act` after
    each) follows, then one bias-free matrix to the text model's d_model."""

    kind: Literal["pixel_shuffle"] = "pixel_shuffle"
    ratio: PositiveFloat
    adapter: PositiveInt
    act: Activation = "gelu"


class LinearProjector(Node):
    """Llama 3.2 Vision: one matrix from every encoder token's features (the final output and the
    kept intermediate layers' outputs side by side) to the text model's d_model."""

    kind: Literal["linear"] = "linear"
    bias: bool = True


Projector = Annotated[Union[PooledProjector, PixelShuffleProjector, LinearProjector], Field(discriminator="kind")]


class ImagePlaceholders(Node):
    """The projected image tokens replace the embeddings of the `token` placeholders that the
    processor writes into the text (between `begin` and `end`, one placeholder per soft token)."""

    kind: Literal["placeholder"] = "placeholder"
    token: int = Field(ge=0)
    begin: int | None = Field(default=None, ge=0)
    end: int | None = Field(default=None, ge=0)
    # Gemma 3: one image's tokens see each other both ways; the text stays causal.
    bidirectional: bool = False


class CrossAttentionEntry(Node):
    """The projected image tokens are the keys and values of the text model's cross_attention
    layers (Llama 3.2 Vision); the text holds one `token` per image where the processor put it, an
    ordinary token to the text model."""

    kind: Literal["cross_attention"] = "cross_attention"
    token: int = Field(ge=0)

    @property
    def bidirectional(self) -> bool:
        """No image tokens in the text, so no image mask there (as placeholders may ask)."""
        return False


class Tiles(Node):
    """Llama 3.2 Vision: an image arrives as up to `max` square tiles laid out by one of
    `aspect_ratios` arrangements (ids 1..aspect_ratios; 0 is no image). Learned, tanh-gated
    embeddings per (arrangement, tile) join the patches before and after the local encoder, and per
    (arrangement, tile, position) join the positions; the class token comes first."""

    kind: Literal["tiles"] = "tiles"
    max: PositiveInt
    aspect_ratios: PositiveInt


ImageEntry = Annotated[Union[ImagePlaceholders, CrossAttentionEntry], Field(discriminator="kind")]


class VisionTower(Node):
    kind: Literal["vision"] = "vision"
    image: PositiveInt  # side of the square input image, in pixels
    d_model: PositiveInt  # the encoder's width
    patches: Patches
    positions: VisionPositions | None
    block: EncoderBlock
    layers: PositiveInt
    final_norm: Norm | None
    projector: Projector
    entry: ImageEntry
    # Llama 4: a learned class embedding after the patches (its own learned position, last; the
    # projector never sees it), a norm before the encoder, and a 2D RoPE in every encoder layer.
    class_token: bool = False
    pre_norm: Norm | None = None
    rope: AxialRope | None = None
    # Llama 3.2 Vision: tiles, a gated global encoder of `global_layers` layers after the final
    # norm, and the local layers (counted from 0) whose outputs join the global encoder's.
    tiles: Tiles | None = None
    global_layers: int = Field(default=0, ge=0)
    intermediate: tuple[int, ...] = ()

    # Llama 4's and Llama 3.2 Vision's parts: absent unless given.
    _omit = omit_at_default("class_token", "pre_norm", "rope", "tiles", "global_layers", "intermediate")

    @property
    def patches_per_side(self) -> int:
        return (self.image - self.patches.size) // self.patches.stride + 1

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


class ModelSpec(Node):
    name: str
    vocab: PositiveInt
    d_model: PositiveInt
    max_seq: PositiveInt
    embedding: Embedding
    final_norm: Norm
    final_softcap: PositiveFloat | None = None
    param_dtype: DType = "float32"
    compute_dtype: DType = "bfloat16"
    blocks: dict[str, Block]
    layers: tuple[Segment, ...]
    mtp: MTP | None = None
    shard: dict[LogicalAxis, tuple[MeshAxis, ...]] = {}
    mesh: dict[MeshAxis, PositiveInt] = {}
    quantize: QuantizationName | None = None
    vision: VisionTower | None = None  # an image encoder and how its output enters the text

    _omit = omit_at_default("quantize", "vision")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The block name of every layer, in order."""
        return tuple(name for seg in self.layers for _ in range(seg.repeat) for name in seg.period)

    @property
    def num_layers(self) -> int:
        return sum(len(seg.period) * seg.repeat for seg in self.layers)
