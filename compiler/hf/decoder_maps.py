"""The tensor maps of an HF decoder whose layers follow Llama's but for the feed-forward (the
MoE families): written once, each family giving only its feed-forward's maps."""

from __future__ import annotations

from typing import Callable, Iterator

from mxc.compiler.hf.mapping import TensorMap, attention_maps, layer_entry, norm_maps, top_level_maps
from mxc.compiler.lower.params import layer_slots
from mxc.spec.ir import ModelSpec

# feed_forward_maps(entry, block.mlp, block name): the maps of one layer's feed-forward.
FeedForwardMaps = Callable[..., Iterator[TensorMap]]


def decoder_maps(spec: ModelSpec, feed_forward_maps: FeedForwardMaps) -> Iterator[TensorMap]:
    """Embedding, final norm and head, then each layer's norms, attention and feed-forward."""
    yield from top_level_maps(spec)
    for slot in layer_slots(spec):
        block = spec.blocks[slot.block]
        entry = layer_entry(slot)
        yield from norm_maps(entry, block, slot.block)
        yield from attention_maps(entry, block.attention, slot.block)
        yield from feed_forward_maps(entry, block.mlp, slot.block)
