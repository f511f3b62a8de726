"""What one layer computes per microbatch, and what each remat policy keeps for the backward pass.

The names are the checkpoint names the layer code tags (mxc.compiler.lower.remat); the unnamed
intermediates are what autodiff keeps when nothing is rematerialised. Shapes are global, with
logical axes, so a Choice turns them into one device's bytes.
"""

from __future__ import annotations

import functools

from mxc.compiler.kinds import kind_of
from mxc.compiler.kinds.base import Intermediate
from mxc.compiler.kinds.vision import encoder_layers, encoder_tokens, untagged_kept_names
from mxc.compiler.lower.block import GATHERED_AXES
from mxc.compiler.plan.choice import Choice
from mxc.spec.ir import Block

QKV = ("query_proj", "key_proj", "value_proj")
# The intermediates each checkpoint name tags (the names are the lowering's, remat.py; the layer
# input is the one a policy may offload rather than keep). "mlpwi" also tags the routed experts'
# input projections, which the MoE kind lists as "expert_mlpwi".
TAGGED = {"decoder_layer_input": ("layer_input",), "mlpwi": ("mlpwi", "expert_mlpwi"),
          **{name: (name,) for name in (*QKV, "context", "out_proj", "mlpwo")}}
# What jax's dots_with_no_batch_dims policy (MaxText's "minimal") keeps: every projection, not
# the attention core's products, and not the routed experts' products either: the capacity
# path's are einsums with the experts as a batch dimension and the dropless path's are
# ragged_dots, neither of which that policy saves (Mixtral 8x7B on v5p-256, minimal_with_context:
# XLA 24.0 GiB; counting them as kept predicted 60.2 GiB, docs/plans.md).
DOTS = (*QKV, "out_proj", "mlpwi", "mlpwo")

# Intermediates the backward pass never reads, whatever is kept: the feed-forward's output only
# joins the residual stream (the next layer keeps that sum as its input).
NEVER_READ = frozenset({"mlpwo"})
# In a parallel block attention's output only joins the residual stream too (no norm reads it):
# XLA's TPU program of MaxText's 32B parallel layer (fsdp 16 x tensor 4 on v5p-128, minimal) saves
# q/k/v, mlpwi and the layer input per layer, 2112 MiB, and no out_proj (counting it: 2432).
NEVER_READ_IN_PARALLEL = NEVER_READ | {"out_proj"}


def never_read(block: Block) -> frozenset[str]:
    """The intermediates of a layer that its backward pass never reads."""
    return NEVER_READ_IN_PARALLEL if block.parallel else NEVER_READ
# What plain autodiff (no remat) does not keep either: RoPE is linear, so its inputs are not
# needed, and the attention output is needed only through the residual sum, which is kept.
NOT_KEPT_WITHOUT_REMAT = NEVER_READ | {"query_proj", "key_proj", "out_proj"}
# What plain autodiff keeps beyond the layer's named values, read off the stacks XLA's TPU program
# saves (the two-layer Llama of tests/test_memory_no_remat.py, v5e-8, fsdp 8, no remat): each norm
# on the residual stream its input in float32 and the square's derivative (2x), both float32; a
# SiLU its sigmoid and the sigmoid's derivative, in the compute dtype. The other norms and
# activations are counted alike or not at all: unmeasured.
NORM_FLOAT32_COPIES = 2
SILU_DERIVATIVE_COPIES = 2


@functools.lru_cache(maxsize=256)
def kept_names(policy: str) -> tuple[frozenset[str], frozenset[str]]:
    """(intermediates kept on device, intermediates offloaded to host) under a remat policy; "*"
    on device: everything autodiff would keep. The layer's input is kept on device unless the
    policy offloads it (jax.checkpoint saves a function's inputs; the layer code names it)."""
    from mxc.compiler.lower.remat import saved

    kept = saved(policy)
    if kept.everything:
        return frozenset({"*"}), frozenset()
    device = {tagged for name in kept.device for tagged in TAGGED[name]}
    host = {tagged for name in kept.host for tagged in TAGGED[name]}
    if kept.dots:
        (device if kept.dots == "device" else host).update(DOTS)
    if "layer_input" not in host:
        device.add("layer_input")
    return frozenset(device), frozenset(host)


class _Recomputed(dict):
    """Matmuls the backward pass recomputes under each policy (their outputs were not kept and
    are needed again), by policy name, any name remat.policy accepts. "core" is attention's QK^T
    and AV; the output projections of attention and of the feed-forward feed only the residual
    stream, so the feed-forward's is never redone and attention's only where out_proj is not
    kept."""

    def __missing__(self, policy: str) -> tuple[str, ...]:
        device, host = kept_names(policy)
        kept = device | host
        if "*" in kept:
            return ()
        groups = {"qkv": not set(QKV) <= kept, "core": "context" not in kept, "out": "out_proj" not in kept,
                  "mlp_in": "mlpwi" not in kept}
        self[policy] = tuple(group for group, redone in groups.items() if redone)
        return self[policy]


RECOMPUTED: dict[str, tuple[str, ...]] = _Recomputed()


def intermediates(block: Block, choice: Choice) -> list[Intermediate]:
    """One layer's intermediates for one microbatch, in the order the forward pass makes them."""
    b, s, d = choice.microbatch, choice.seq, choice.spec.d_model
    act = choice.compute_bytes
    att, ffn = block.attention, block.mlp
    v_dim = kind_of(att).value_head_dim(att)
    tokens = ("batch", "seq")
    # The residual stream and what is computed on it token by token (norms), split like it: with
    # sequence parallelism over tensor too (mxc.compiler.lower.sharding.RESIDUAL_AXES).
    residual = ("batch", "residual_seq", "embed")
    out = [
        Intermediate("layer_input", (b, s, d), residual, act),
        # A parallel block gathers its one normed input whole over the sequence for both sub-layers.
        Intermediate("attention_norm_out", (b, s, d), GATHERED_AXES if block.parallel else residual, act),
    ]
    own_core = getattr(kind_of(att), "attention_intermediates", None)  # cross-attention's: keys over images
    if own_core is not None:
        out += own_core(att, choice)
    else:
        out += [
            Intermediate("query_proj", (b, s, att.heads, att.head_dim), (*tokens, "heads", "head_dim"), act),
            Intermediate("key_proj", (b, s, att.kv_heads, att.head_dim), (*tokens, "kv_heads", "head_dim"), act),
            Intermediate("value_proj", (b, s, att.kv_heads, v_dim), (*tokens, "kv_heads", "head_dim"), act),
            # RoPE'd queries and keys: new arrays the core reads
            Intermediate("query_rotated", (b, s, att.heads, att.head_dim), (*tokens, "heads", "head_dim"), act),
            Intermediate("key_rotated", (b, s, att.kv_heads, att.head_dim), (*tokens, "kv_heads", "head_dim"), act),
        ]
        if choice.attention.startswith("splash"):
            # Flash attention keeps only the softmax statistics per query.
            out.append(Intermediate("attention_statistics", (b, att.heads, s), ("batch", "heads", "seq"), 4))
        else:
            # The XLA path materialises the probabilities, in float32.
            out.append(Intermediate("attention_probabilities", (b, att.heads, s, s), ("batch", "heads", "seq", None), 4))
        out.append(Intermediate("context", (b, s, att.heads, v_dim), (*tokens, "heads", "head_dim"), act))
    out.append(Intermediate("out_proj", (b, s, d), residual, act))
    if not block.parallel:  # a parallel block's feed-forward reads the layer's one normed input
        out += [Intermediate("attention_residual", (b, s, d), residual, act),
                Intermediate("mlp_norm_out", (b, s, d), residual, act)]
    out += kind_of(ffn).intermediates(ffn, choice)
    return out


def intermediate_bytes(block_name: str, choice: Choice) -> dict[str, int]:
    """One device's bytes of each of a layer kind's intermediates, by name."""
    def compute() -> dict[str, int]:
        out: dict[str, int] = {}
        for item in intermediates(choice.spec.blocks[block_name], choice):
            out[item.name] = out.get(item.name, 0) + choice.local(item.shape, item.axes) * item.bytes_per_element
        return out

    return choice.memo(f"intermediates/{block_name}", compute, shapes=True)


def layer_bytes(block_name: str, choice: Choice, policy: str) -> tuple[int, int]:
    """(device bytes, host bytes) one layer of a kind keeps for the backward pass under `policy`."""
    kept, offloaded = kept_names(policy)
    sizes = intermediate_bytes(block_name, choice)
    unread = never_read(choice.spec.blocks[block_name])
    if "*" in kept:
        named = sum(size for name, size in sizes.items() if name not in NOT_KEPT_WITHOUT_REMAT)
        return named + autodiff_extra_bytes(block_name, choice), 0
    device = sum(size for name, size in sizes.items() if name in kept and name not in unread)
    return device, sum(size for name, size in sizes.items() if name in offloaded and name not in unread)


def autodiff_extra_bytes(block_name: str, choice: Choice) -> int:
    """One layer's values plain autodiff keeps that the layer does not name (NORM_FLOAT32_COPIES,
    SILU_DERIVATIVE_COPIES): they count only where nothing is rematerialised."""
    block = choice.spec.blocks[block_name]
    sizes = intermediate_bytes(block_name, choice)
    # float32 copies of a residual-shaped value: twice the compute dtype's layer input (bfloat16)
    residual_float32 = sizes["layer_input"] * 4 // choice.compute_bytes
    norms = (1 if block.parallel else 2) * (2 if block.post_norm is not None else 1)
    extra = NORM_FLOAT32_COPIES * norms * residual_float32
    if getattr(block.mlp, "act", None) == "silu" and "mlp_activation" in sizes:
        extra += SILU_DERIVATIVE_COPIES * sizes["mlp_activation"]
    return extra


def layer_recomputed_bytes(block_name: str, choice: Choice) -> int:
    """What one layer's backward recomputes under the plan's policy: every intermediate the policy
    neither keeps nor offloads and the backward reads (0 without remat)."""
    kept, offloaded = kept_names(choice.remat)
    if "*" in kept:
        return 0
    unread = never_read(choice.spec.blocks[block_name])
    return sum(size for name, size in intermediate_bytes(block_name, choice).items()
               if name not in kept and name not in offloaded and name not in unread)


def layer_working_bytes(block_name: str, choice: Choice) -> int:
    """Everything one layer's forward produces: what its backward holds at once while it
    recomputes and differentiates that layer."""
    return sum(intermediate_bytes(block_name, choice).values())


def dispatch_bytes(block_name: str, choice: Choice) -> int:
    """One layer's dropless expert-dispatch buffers (0 on the capacity path and without experts)."""
    from mxc.compiler.kinds.moe import DISPATCH_BUFFERS

    if choice.expert_path != "dropless":
        return 0
    return sum(size for name, size in intermediate_bytes(block_name, choice).items() if name in DISPATCH_BUFFERS)


# Where megablox runs in a region manual over every mesh axis (megablox_region), every sorted
# row belongs to one of the device's groups: the kernel reads the sorted rows as they are (no
# masked copy of them, compiler/lower/megablox.py), and the expert's activation is fused into the
# product that feeds `down`. XLA's buffer assignment of DeepSeek V3's MoE layer backward (v5p-1024,
# fsdp 512, 49152 tokens x top 8 a device): three [393216, 7168] row buffers (the sorted rows, the
# output's, the combined) and three [393216, 2048] (gate, up, and the hidden units or their
# gradient) at once, 20.25 GiB, where the dispatch's names count four of each, 27.0 GiB.
NOT_HELD_IN_MEGABLOX_REGION = frozenset({"grouped_rows", "expert_mlp_activation"})


def megablox_layout(block_name: str, choice: Choice) -> bool:
    """Whether the choice's layout lets a layer's routed experts, unsplit, run megablox in a
    region manual over every mesh axis (megablox_hidden_axes, the lowering's rule)."""
    from mxc.compiler.lower.moe import megablox_hidden_axes

    ffn = choice.spec.blocks[block_name].mlp
    if choice.split("experts") > 1 or kind_of(ffn).routing(ffn) is None:
        return False
    return megablox_hidden_axes(choice.mesh, choice.rules.get("batch", ()), choice.rules.get("mlp", ()),
                                bool(getattr(ffn.expert, "bias", False))) is not None


def megablox_region(block_name: str, choice: Choice) -> bool:
    """Whether a layer's dropless experts run megablox in that region: on TPU, where the layout
    allows it (megablox_layout)."""
    return (choice.topology.platform == "tpu" and choice.expert_path == "dropless"
            and megablox_layout(block_name, choice))


def dispatch_held_bytes(block_name: str, choice: Choice) -> int:
    """What of the dropless dispatch's buffers a layer's backward holds at once: all of them,
    but for those megablox's region makes no separate buffer of (NOT_HELD_IN_MEGABLOX_REGION)."""
    from mxc.compiler.kinds.moe import DISPATCH_BUFFERS

    if choice.expert_path != "dropless":
        return 0
    unheld = NOT_HELD_IN_MEGABLOX_REGION if megablox_region(block_name, choice) else frozenset()
    return sum(size for name, size in intermediate_bytes(block_name, choice).items()
               if name in DISPATCH_BUFFERS and name not in unheld)


def attention_score_bytes(block_name: str, choice: Choice) -> int:
    """One layer's materialised attention probabilities (the XLA path; 0 under flash attention)."""
    return intermediate_bytes(block_name, choice).get("attention_probabilities", 0)


class _EncoderView:
    """A Choice as the vision encoder sees it: the microbatch's images as the batch, the patches
    as the sequence, the tower's width as d_model, the xla attention path (the encoder never
    runs splash); sharding and dtypes are the plan's."""

    def __init__(self, choice: Choice, images: int):
        tower = choice.spec.vision
        self._choice = choice
        self.microbatch, self.seq, self.attention = images, encoder_tokens(tower), "xla"
        self.spec = choice.spec.model_copy(update={"d_model": tower.d_model})

    def __getattr__(self, name):
        return getattr(self._choice, name)


def vision_bytes(choice: Choice, images_per_row: int = 1) -> tuple[int, int]:
    """(kept, working) device bytes of the vision encoder in one microbatch of `images_per_row`
    images per sequence (the compiled batch's default, compiler.aot.image_slots): what its layers
    keep for the backward pass under the plan's remat policy, all layers together, and what one
    layer holds while it is differentiated (its intermediates at the dense layers' working share,
    its float32 attention probabilities twice, as the text layers' xla path). 0, 0 without a tower."""
    tower = choice.spec.vision
    if tower is None or images_per_row == 0:
        return 0, 0
    view = _EncoderView(choice, choice.microbatch * images_per_row)
    sizes: dict[str, int] = {}
    for item in intermediates(tower.block, view):
        sizes[item.name] = sizes.get(item.name, 0) + choice.local(item.shape, item.axes) * item.bytes_per_element
    kept, _ = kept_names(choice.remat)
    if "*" in kept:
        stack = encoder_layers(tower) * sum(size for name, size in sizes.items() if name not in NOT_KEPT_WITHOUT_REMAT)
    elif tower.tiles is not None:  # its layers tag no names (kinds.vision.untagged_kept_names)
        from mxc.compiler.lower.remat import saved

        dots = saved(choice.remat).dots == "device"
        stack = sum(count * sum(sizes.get(name, 0) for name in untagged_kept_names(dots, gated))
                    for count, gated in ((tower.layers, False), (tower.global_layers, True)))
    else:
        stack = tower.layers * sum(size for name, size in sizes.items() if name in kept and name not in NEVER_READ)
    scores = sizes.get("attention_probabilities", 0)
    return stack, int(VISION_WORKING_SHARE * sum(sizes.values()) + 2 * scores)


# The share of one encoder layer's intermediates live in its backward, as for the text layers
# (memory.LAYER_WORKING_SET, measured on them).
VISION_WORKING_SHARE = 0.4
