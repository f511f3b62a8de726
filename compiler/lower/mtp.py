"""DeepSeek V3's multi-token prediction (arXiv:2412.19437, section 2.2): training only.

Module k (k = 1 .. depth) predicts the token k + 1 places ahead. At position i it joins the
previous depth's representation h⁽ᵏ⁻¹⁾ᵢ with the embedding of token i + k,

    h'ᵢ  = embedding_norm(Emb(t₍ᵢ₊ₖ₎))·projection[0] + hidden_norm(h⁽ᵏ⁻¹⁾ᵢ)·projection[1]
    h⁽ᵏ⁾ = output_norm(Block_k(h'))

and the main model's output head turns h⁽ᵏ⁾ᵢ into logits for t₍ᵢ₊ₖ₊₁₎. The embedding and the head
are the main model's own. h⁽⁰⁾ is the main model's output after its final norm, the embedding
comes first in the concatenation, and the normalised h⁽ᵏ⁾ is what the next depth receives: so
transformers' MtpLayer/MtpModel and vLLM's DeepSeek MTP do it, the references that run DeepSeek's
released MTP weights (whose eh_proj [d_model, 2·d_model] is `projection` cut in its two halves).
A module's block sees positions shifted by k, like the tokens it embeds; rotary attention only
sees position differences, so this changes nothing but keeps the positions the tokens' own.
In a packed sequence (segment ids in the batch) a module's attention stays inside the document of
position i, like the main model's, and a target in a later document than position i is masked:
running each document alone has no such target.

The loss of depth k is the cross entropy summed over the positions whose target exists (the last
k of each row have none) and masked like the main targets; the depths are averaged and weighted by
`loss_weight`, the paper's L_MTP = λ/D Σ_k L_k. Like the main loss the sum is divided by the batch's
main token count, so microbatching stays exact; per depth that is the paper's mean times
(seq - k) / seq.

Inference never runs these modules: forward, prefill and decode ignore params["mtp"].

Parameters, stacked over depth on a leading "layers" axis:
    {"embedding_norm": {"scale"}, "hidden_norm": {"scale"},
     "projection": {"kernel": [2, embed, embed]},
     "block": the block_defs of spec.mtp.block, "output_norm": {"scale"}}
the norms being of the model's final_norm kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.lower.block import block_layer_with_stats
from mxc.compiler.lower.loss import loss_sums
from mxc.compiler.lower.model import embed, output_head
from mxc.compiler.lower.moe import MoEConfig, update_correction_biases
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.params import ParamDef, block_defs, norm_defs
from mxc.compiler.lower.sharding import constrain
from mxc.spec.ir import ModelSpec, Segment


def mtp_defs(spec: ModelSpec) -> dict:
    """The modules' ParamDefs, stacked over depth."""
    d = spec.d_model
    module = {"embedding_norm": norm_defs(spec.final_norm, d, "embed"),
              "hidden_norm": norm_defs(spec.final_norm, d, "embed"),
              "projection": {"kernel": ParamDef((2, d, d), (None, "embed", "embed"), "normal")},
              "block": block_defs(spec.blocks[spec.mtp.block], d),
              "output_norm": norm_defs(spec.final_norm, d, "embed")}
    return jax.tree.map(lambda p: p.stacked(spec.mtp.depth), module, is_leaf=lambda x: isinstance(x, ParamDef))


def _ahead(x: jax.Array, k: int) -> jax.Array:
    """x[:, i + k] at position i; zeros (a masked-out target, a padding token) past the end."""
    return jnp.concatenate([x[:, k:], jnp.zeros((x.shape[0], k), x.dtype)], axis=1)


def mtp_hidden(spec: ModelSpec, params: dict, hidden: jax.Array, inputs: jax.Array, *, positions=None,
               segment_ids=None, remat_policy=None, attention_impl: str = "xla",
               moe: MoEConfig = MoEConfig()) -> list[tuple[jax.Array, object]]:
    """Each module's normalised output h⁽ᵏ⁾ [batch, seq, embed] (position i predicts token i + k + 1;
    the last k positions embed padding and predict nothing), with its block's MoEStats or None.

    hidden [batch, seq, embed] is model.decoder_hidden's output for `inputs` [batch, seq] at
    `positions` with `segment_ids` (both [batch, seq] or None, as decoder_hidden took them)."""
    mtp = spec.mtp
    block = spec.blocks[mtp.block]
    norm = spec.final_norm
    rows, seq = inputs.shape
    if seq <= mtp.depth:
        raise ValueError(f"multi-token prediction of depth {mtp.depth} needs sequences longer than {mtp.depth}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None, :], (rows, seq))
    positions = positions.astype(jnp.int32)

    def module_step(module, h, tokens, positions):
        e = apply_norm(norm, module["embedding_norm"], embed(spec, params, tokens, hidden.dtype))
        h = apply_norm(norm, module["hidden_norm"], h)
        kernel = module["projection"]["kernel"].astype(hidden.dtype)
        x = jnp.einsum("bse,ef->bsf", e, kernel[0]) + jnp.einsum("bse,ef->bsf", h, kernel[1])
        x = constrain(x, ("batch", "seq", "embed"))
        x, _, stats = block_layer_with_stats(block, module["block"], x, positions, segment_ids=segment_ids,
                                             impl=attention_impl, moe=moe)
        return apply_norm(norm, module["output_norm"], x), stats

    if remat_policy is not None:
        module_step = jax.checkpoint(module_step, policy=remat_policy, prevent_cse=False)
    h = apply_norm(norm, params["final_norm"], hidden)
    outputs = []
    for k in range(1, mtp.depth + 1):
        module = jax.tree.map(lambda a: a[k - 1], params["mtp"])
        h, stats = module_step(module, h, _ahead(inputs, k), positions + k)
        outputs.append((h, stats))
    return outputs


def mtp_loss(spec: ModelSpec, params: dict, hidden: jax.Array, batch: dict, *, remat_policy=None,
             attention_impl: str = "xla", moe: MoEConfig = MoEConfig()) -> tuple[jax.Array, list]:
    """(the weighted cross-entropy sum for LossSums.mtp, the modules' MoE statistics).

    hidden [batch, seq, embed] is model.decoder_hidden's output for batch["inputs"]; the batch is
    the train step's (inputs, targets, mask). The statistics come nested like one more segment of
    model.forward_with_aux's: [MoEStats stacked over depth], or [None] for a dense block."""
    segment_ids = batch.get("segment_ids")
    outputs = mtp_hidden(spec, params, hidden, batch["inputs"], positions=batch.get("positions"),
                         segment_ids=segment_ids, remat_policy=remat_policy, attention_impl=attention_impl, moe=moe)
    total = jnp.zeros((), jnp.float32)
    for k, (h, _) in enumerate(outputs, start=1):
        mask = _ahead(batch["mask"], k)
        if segment_ids is not None:  # the target at i + k must still be in position i's document
            mask = mask * (_ahead(segment_ids, k) == segment_ids).astype(mask.dtype)
        sums = loss_sums(output_head(spec, params, h), _ahead(batch["targets"], k), mask)
        total = total + sums.cross_entropy
    all_stats = [stats for _, stats in outputs]
    stacked = None if all_stats[0] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *all_stats)
    return spec.mtp.loss_weight / spec.mtp.depth * total, [stacked]


def update_mtp_correction_biases(spec: ModelSpec, params: dict, loads: list, rate: float) -> dict:
    """DeepSeek V3's bias update (moe.update_correction_biases) for the modules' MoE block; loads is
    the modules' entry of the step's expert loads, [[depth, experts]]. The modules are stacked like
    one segment of `depth` layers, so they are updated as one."""
    as_segment = spec.model_copy(update={"layers": (Segment(period=(spec.mtp.block,), repeat=spec.mtp.depth),)})
    updated = update_correction_biases(as_segment, {"segments": [[params["mtp"]["block"]]]}, [loads], rate)
    return {**params, "mtp": {**params["mtp"], "block": updated["segments"][0][0]}}
