"""The vision tower (spec.ir.VisionTower): its checks, parameter definitions and counts.

Its encoder layers are ordinary blocks (any attention, feed-forward and norm kind of the text
model), so their parameters and counts come from the same kinds; the tower adds the patch
projection, the position table, the final norm and the projector. The lowering is
mxc.compiler.lower.vision.
"""

from __future__ import annotations

import math

from mxc.compiler.kinds import kind_of
from mxc.compiler.kinds.base import Report
from mxc.compiler.lower.param_def import ParamDef, is_def, linear, map_defs, matrix, norm_defs
from mxc.spec.ir import (CrossAttentionEntry, LearnedPositions, LinearProjector, ModelSpec, PixelShuffleProjector,
                         PooledProjector, VisionTower)

PATH = ("vision",)


def check(spec: ModelSpec, report: Report) -> None:
    tower = spec.vision
    patches = tower.patches
    if patches.size > tower.image:
        report(PATH + ("patches", "size"), f"patch size ({patches.size}) is larger than the image ({tower.image})")
    elif (tower.image - patches.size) % patches.stride:
        report(PATH + ("patches", "stride"),
               f"patches of {patches.size} every {patches.stride} pixels do not tile an image of {tower.image}",
               "(image - size) must be a multiple of stride")
    att = tower.block.attention
    kind_of(att).check(att, PATH + ("block", "attention"), report)
    kind_of(tower.block.mlp).check(tower.block.mlp, PATH + ("block", "mlp"), report)
    for field in ("window", "chunk"):
        if getattr(att, field) is not None:
            report(PATH + ("block", "attention", field), f"a vision encoder's attention sees the whole image (no {field})")
    if tower.block.parallel:
        report(PATH + ("block", "parallel"), "a vision tower's encoder block cannot be parallel", "set parallel = false")
    projector = tower.projector
    if isinstance(projector, PooledProjector):
        side = math.isqrt(projector.tokens)
        if side * side != projector.tokens:
            report(PATH + ("projector", "tokens"), f"tokens per image ({projector.tokens}) must be a square number",
                   "the pooled grid is square")
        elif tower.patches_per_side % side:
            report(PATH + ("projector", "tokens"),
                   f"a {tower.patches_per_side}x{tower.patches_per_side} patch grid does not pool evenly "
                   f"to {side}x{side} tokens")
    if isinstance(projector, PixelShuffleProjector):
        side, width = tower.patches_per_side * projector.ratio, tower.d_model / projector.ratio ** 2
        if side != int(side) or width != int(width):
            report(PATH + ("projector", "ratio"),
                   f"a pixel shuffle of ratio {projector.ratio} needs whole numbers of patches per side "
                   f"({tower.patches_per_side} x ratio) and of channels ({tower.d_model} / ratio²)")
    if tower.rope is not None:
        if att.rope is not None:
            report(PATH + ("block", "attention", "rope"), "the tower's rope_2d already rotates the encoder's "
                   "queries and keys", "write rope = none in the encoder block")
        if getattr(att, "head_dim", 0) % 4:
            report(PATH + ("block", "attention", "head_dim"), f"the tower's rope_2d splits each head in quarters; "
                   f"head_dim {att.head_dim} is not a multiple of 4")
    _check_tiles(tower, report)
    entry = tower.entry
    for field, what in (("token", "image placeholder"), ("begin", "begin-of-image"), ("end", "end-of-image")):
        value = getattr(entry, field, None)
        rows = spec.vocab + spec.embedding.extra_rows  # the input table's rows
        if value is not None and value >= rows:
            report(PATH + ("entry", field), f"the {what} token ({value}) is outside the vocabulary ({rows})")


def _check_tiles(tower: VisionTower, report) -> None:
    """Llama 3.2 Vision's parts come together: tiles, the linear projector of the kept layers'
    features, the cross-attention entry, a class token and learned positions."""
    linear, cross = isinstance(tower.projector, LinearProjector), isinstance(tower.entry, CrossAttentionEntry)
    if tower.tiles is not None or linear or cross:
        for field, fits in (("projector", linear), ("entry", cross)):
            if not fits:
                report(PATH + (field,), f"this {field} does not fit Llama 3.2 Vision's tower, which needs "
                       "tiles = tiles(...), projector = linear() and entry = cross_attention(...)")
        if tower.tiles is None:
            report(PATH + ("tiles",), "a linear projector or a cross_attention entry "
                   "is part of Llama 3.2 Vision's tower, which also needs tiles = tiles(...)")
    for index, layer in enumerate(tower.intermediate):
        if layer >= tower.layers:
            report(PATH + ("intermediate", index), f"intermediate layer {layer} is not one of the "
                   f"{tower.layers} encoder layers (counted from 0)")
    if (tower.intermediate or tower.global_layers) and tower.tiles is None:
        field = "intermediate" if tower.intermediate else "global_layers"
        report(PATH + (field,), f"{field} is part of Llama 3.2 Vision's tower, which needs tiles = tiles(...)")
    if tower.tiles is not None:
        if not tower.class_token or not isinstance(tower.positions, LearnedPositions):
            report(PATH + ("tiles",), "a tiled tower needs class_token = true and positions = learned()")
        if tower.pre_norm is None or tower.final_norm is None:
            report(PATH + ("tiles",), "a tiled tower needs pre_norm and final_norm (around its local encoder)")


def output_width(tower: VisionTower) -> int:
    """Features per encoder token that the projector reads: the final output and, for a tiled
    tower, each kept intermediate layer's."""
    return tower.d_model * (1 + len(tower.intermediate))


def tokens_per_image(tower: VisionTower) -> int:
    """The projected tokens one image gives the text model (for a tiled tower: the keys of its
    cross-attention layers, every token of every tile, padding tiles included)."""
    if isinstance(tower.projector, LinearProjector):
        return tower.tiles.max * num_positions(tower)
    if isinstance(tower.projector, PixelShuffleProjector):
        return round(tower.num_patches * tower.projector.ratio ** 2)
    return tower.projector.tokens


def num_positions(tower: VisionTower) -> int:
    """Tokens the encoder runs over: the patches, and the class token where there is one."""
    return tower.num_patches + int(tower.class_token)


def encoder_tokens(tower: VisionTower) -> int:
    """Tokens one image's encoder layers run over (the planner's activations): its patches, or for
    a tiled tower every tile's positions, each tile padded to a multiple of 8
    (mxc.compiler.lower.vision_mllama runs an image's tiles as one sequence)."""
    if tower.tiles is None:
        return tower.num_patches
    from mxc.compiler.lower.vision_mllama import padded_tokens

    return tower.tiles.max * padded_tokens(tower)


def encoder_layers(tower: VisionTower) -> int:
    """Encoder layers an image goes through: the local ones and a tiled tower's global ones."""
    return tower.layers + tower.global_layers


def untagged_kept_names(dots: bool, gated: bool) -> frozenset[str]:
    """What a remat policy keeps of a tiled tower's encoder layer for the backward pass: its
    layers (mxc.compiler.lower.vision_mllama) tag no checkpoint names, so only the layer's input
    and, under a policy that saves the weights' products (`dots`), its projections; a gated
    (global) layer's feed-forward output too, which its gate's gradient reads. Names as
    plan.activations.intermediates gives them (checked against XLA's buffer assignment:
    docs/multimodal.md, Llama 3.2 Vision)."""
    names = {"layer_input"}
    if dots:
        names |= {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi"} | ({"mlpwo"} if gated else set())
    return frozenset(names)


def _shuffled_width(tower: VisionTower) -> int:
    return round(tower.d_model / tower.projector.ratio ** 2)


def param_defs(spec: ModelSpec) -> dict:
    """{"patches", "positions", "layers" (stacked blocks), "final_norm", "projector"}. The tower's
    width shares the logical axis `embed` with the text model; the projector's input is unnamed
    so that its two dimensions never ask for the same mesh axis."""
    from mxc.compiler.lower.params import block_defs

    tower, width = spec.vision, spec.vision.d_model
    p = tower.patches
    defs = {"patches": linear((p.size, p.size, p.channels), (None, None, None), (width,), ("embed",), p.bias),
            "layers": map_defs(lambda d: d.stacked(tower.layers), block_defs(tower.block, width))}
    if isinstance(tower.positions, LearnedPositions):
        defs["positions"] = {"embedding": matrix((num_positions(tower), width), (None, "embed"))}
    if tower.tiles is not None:
        defs.update(_tile_defs(tower))
        gates = {"attention_gate": ParamDef((), (), "zeros"), "mlp_gate": ParamDef((), (), "zeros")}
        defs["global_layers"] = map_defs(lambda d: d.stacked(tower.global_layers),
                                         {**block_defs(tower.block, width), **gates})
    if tower.class_token:
        defs["class_embedding"] = matrix((width,), ("embed",))
    if tower.pre_norm is not None:
        defs["pre_norm"] = norm_defs(tower.pre_norm, width, "embed")
    if tower.final_norm is not None:
        defs["final_norm"] = norm_defs(tower.final_norm, width, "embed")
    projector = tower.projector
    if isinstance(projector, PixelShuffleProjector):
        adapter = projector.adapter
        defs["projector"] = {"adapter": {"up": {"kernel": matrix((_shuffled_width(tower), adapter), (None, "mlp"))},
                                         "down": {"kernel": matrix((adapter, adapter), ("mlp", None))}},
                             "kernel": matrix((adapter, spec.d_model), (None, "embed"))}
    elif isinstance(projector, LinearProjector):
        defs["projector"] = linear((output_width(tower),), (None,), (spec.d_model,), ("embed",), projector.bias)
    else:
        defs["projector"] = {"norm": norm_defs(projector.norm, width, "embed"),
                             **linear((width,), (None,), (spec.d_model,), ("embed",), projector.bias)}
    return defs


def _tile_defs(tower: VisionTower) -> dict:
    """The gated tile tables (layout in mxc.compiler.lower.vision_mllama); ids run 0 .. aspect_ratios."""
    tiles, ids, width = tower.tiles.max, tower.tiles.aspect_ratios + 1, tower.d_model
    gate = ParamDef((), (), "zeros")

    def table(*inner):
        return matrix((ids, tiles, *inner, width), (None, None, *(None,) * len(inner), "embed"))

    return {"pre_tile": {"embedding": table(), "gate": gate}, "post_tile": {"embedding": table(), "gate": gate},
            "positions": {"embedding": matrix((num_positions(tower), width), (None, "embed")), "gate": gate,
                          "tile_embedding": table(num_positions(tower))}}


def _tile_count(tower: VisionTower) -> int:
    if tower.tiles is None:
        return 0
    tiles, ids, width = tower.tiles.max, tower.tiles.aspect_ratios + 1, tower.d_model
    from mxc.compiler.analysis import block_params

    global_layers = tower.global_layers * (block_params(tower.block, width).total + 2)
    return 2 * (ids * tiles * width + 1) + ids * tiles * num_positions(tower) * width + 1 + global_layers


def param_count(spec: ModelSpec) -> int:
    """Every parameter of the tower and its projector (0 without one); the same sum as param_defs,
    written out so that counting needs no JAX."""
    from mxc.compiler.analysis import block_params, norm_params

    tower = spec.vision
    if tower is None:
        return 0
    width, p = tower.d_model, tower.patches
    patches = p.size * p.size * p.channels * width + (width if p.bias else 0)
    positions = num_positions(tower) * width if isinstance(tower.positions, LearnedPositions) else 0
    positions += width if tower.class_token else 0
    encoder = (tower.layers * block_params(tower.block, width).total + norm_params(tower.final_norm, width)
               + norm_params(tower.pre_norm, width))
    projector = tower.projector
    if isinstance(projector, PixelShuffleProjector):
        adapter = projector.adapter
        projection = _shuffled_width(tower) * adapter + adapter * adapter + adapter * spec.d_model
    elif isinstance(projector, LinearProjector):
        projection = output_width(tower) * spec.d_model + (spec.d_model if projector.bias else 0)
    else:
        projection = (norm_params(projector.norm, width) + width * spec.d_model
                      + (spec.d_model if projector.bias else 0))
    return patches + positions + encoder + projection + _tile_count(tower)
