"""What one layer computes per microbatch, and what each remat policy keeps for the backward pass.

The names are the checkpoint names the layer code tags (mxc.compiler.lower.remat); the unnamed
intermediates are what autodiff keeps when nothing is rematerialised. Shapes are global, with
logical axes, so a Choice turns them into one device's bytes.
"""

from __future__ import annotations

from mxc.compiler.kinds import kind_of
from mxc.compiler.kinds.base import Intermediate
from mxc.compiler.plan.choice import Choice
from mxc.spec.ir import Block

QKV = ("query_proj", "key_proj", "value_proj")
NAMED = (*QKV, "attention_context", "attention_out", "mlp_in", "mlp_out")

# policy -> (kept on device, offloaded to host). The layer's input, the scan's carry, is always
# kept: jax.checkpoint saves a function's inputs.
POLICIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "none": (("*",), ()),  # everything autodiff would keep
    "full": ((), ()),
    "minimal": (NAMED, ()),
    "save_qkv": (QKV, ()),
    "attention_out": (("attention_out",), ()),
    "save_attention": ((*QKV, "attention_context", "attention_out"), ()),
    # jax's dots_with_no_batch_dims_saveable: every projection, not the attention core's products
    "dots": ((*QKV, "attention_out", "mlp_in", "mlp_out"), ()),
    "minimal_offloaded": ((), NAMED),
    "save_qkv_offloaded": ((), QKV),
}

# Intermediates the backward pass never reads, whatever is kept: the feed-forward's output only
# joins the residual stream (the next layer keeps that sum as its input).
NEVER_READ = frozenset({"mlp_out"})
# What plain autodiff (no remat) does not keep either: RoPE is linear, so its inputs are not
# needed, and the attention output is needed only through the residual sum, which is kept.
NOT_KEPT_WITHOUT_REMAT = NEVER_READ | {"query_proj", "key_proj", "attention_out"}

# Matmuls the backward pass recomputes under each policy (their outputs were not kept and are
# needed again). The output projections of attention and of the feed-forward feed only the
# residual stream; under "full" the attention one is redone (the feed-forward's norm needs the
# sum), the feed-forward one never is. "core" is attention's QK^T and AV.
RECOMPUTED: dict[str, tuple[str, ...]] = {
    "none": (),
    "full": ("qkv", "core", "out", "mlp_in"),
    "minimal": (),
    "save_qkv": ("core", "out", "mlp_in"),
    "attention_out": ("qkv", "core", "mlp_in"),
    "save_attention": ("mlp_in",),
    "dots": ("core",),
    "minimal_offloaded": (),
    "save_qkv_offloaded": ("core", "out", "mlp_in"),
}


def intermediates(block: Block, choice: Choice) -> list[Intermediate]:
    """One layer's intermediates for one microbatch, in the order the forward pass makes them."""
    b, s, d = choice.microbatch, choice.seq, choice.spec.d_model
    act = choice.compute_bytes
    att, ffn = block.attention, block.mlp
    v_dim = kind_of(att).value_head_dim(att)
    tokens = ("batch", "seq")
    out = [
        Intermediate("layer_input", (b, s, d), (*tokens, "embed"), act),
        Intermediate("attention_norm_out", (b, s, d), (*tokens, "embed"), act),
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
    out += [
        Intermediate("attention_context", (b, s, att.heads, v_dim), (*tokens, "heads", "head_dim"), act),
        Intermediate("attention_out", (b, s, d), (*tokens, "embed"), act),
        Intermediate("attention_residual", (b, s, d), (*tokens, "embed"), act),
        Intermediate("mlp_norm_out", (b, s, d), (*tokens, "embed"), act),
    ]
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
    kept, offloaded = POLICIES[policy]
    sizes = intermediate_bytes(block_name, choice)
    if "*" in kept:
        return sum(size for name, size in sizes.items() if name not in NOT_KEPT_WITHOUT_REMAT), 0
    device = sum(size for name, size in sizes.items()
                 if name == "layer_input" or (name in kept and name not in NEVER_READ))
    return device, sum(size for name, size in sizes.items() if name in offloaded and name not in NEVER_READ)


def layer_working_bytes(block_name: str, choice: Choice) -> int:
    """Everything one layer's forward produces: what its backward holds at once while it
    recomputes and differentiates that layer."""
    return sum(intermediate_bytes(block_name, choice).values())


def attention_score_bytes(block_name: str, choice: Choice) -> int:
    """One layer's materialised attention probabilities (the XLA path; 0 under flash attention)."""
    return intermediate_bytes(block_name, choice).get("attention_probabilities", 0)
