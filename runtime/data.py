"""Training batches from a token file: packing, order, per-process assembly, and a position to resume from.

Packing. The token file is one stream of documents, each ended by the end-of-document id. It
is cut into windows of seq + 1 tokens that overlap by one (window i starts at token i·seq), so
every token is a target exactly once; a window's first seq tokens are the inputs, its last seq
the targets. Documents are packed back to back, with no padding.

Document masking. A window holds the end of one document and the start of the next. Each row
carries segment ids (1 for the window's first document, one more after every end-of-document
input) and positions that restart at 0 where a document starts, as MaxText's packing does
(`inputs_segmentation`, `inputs_position`): the model's attention stays inside a document and
RoPE counts from the document's start, so every document is trained as if it ran alone. A
document cut by the window's start counts from the window's start (rotary attention sees only
position differences). With `doc_mask=False`, or a file without an end-of-document id, a row is
one segment at positions 0..seq-1: attention then sees across documents (GPT-2's and nanoGPT's
packing).

The loss mask removes the one prediction that crosses a boundary: the target after an
end-of-document input (the first token of the next document), which nothing in its document
can predict. Predicting the end-of-document token itself stays in the loss: that is how a model
learns to stop.

Order. Each epoch visits every window once, in a permutation drawn from (seed, epoch); the
stream's position is the number of windows consumed, so one integer (saved in the checkpoint)
restores the order exactly, also under another batch size.

Images. A token file with an image sidecar (image_file.py) feeds a model with a vision tower,
whose compiled steps take `slots` images per row (BatchLayout.images). Its rows are cut so that an
image's placeholder run lies whole in one row's inputs: a row ends before a run that would cross
its end, or that would need more slots than the row has, and is padded (inputs the
end-of-document id, mask 0, segment 0); the next row starts at that run. Row b's images fill its
slots in order (pixel_values [batch, slots, C, H, W], image_mask [batch, slots]; tiled images
[batch, slots, tiles, C, H, W] with aspect_ratio_ids [batch, slots]). Targets that are
placeholders stay out of the loss: nothing can predict an image's soft tokens.

Multi-host. The global batch is one jax.Array laid out as the train step expects; each process
builds only the rows its own devices hold (`jax.make_array_from_callback` calls back for
addressable shards only), reading them straight from the memory map.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from mxc.runtime.image_file import ImageFile, open_images
from mxc.runtime.token_file import TokenFile


class DataError(ValueError):
    """Data that cannot feed the program (too short, wrong vocabulary, another position)."""


@dataclass(frozen=True)
class ImageLayout:
    """The image slots of a vision model's batch: pixel_values [batch, slots, *image] and
    image_mask [batch, slots], split along their rows."""

    slots: int
    image: tuple[int, ...]  # channels, height, width (tiles first for a tiled tower)
    pixel_sharding: jax.sharding.Sharding
    mask_sharding: jax.sharding.Sharding


@dataclass(frozen=True)
class BatchLayout:
    """The shape the compiled step takes: [batch, seq] arrays (BATCH_KEYS), and their layout."""

    batch: int
    seq: int
    sharding: jax.sharding.Sharding  # of each [batch, seq] array
    mask_dtype: np.dtype = np.dtype(np.float32)
    images: ImageLayout | None = None  # a vision model's image slots


# What a batch holds, each [batch, seq]; the compiled train and eval steps take all of them.
BATCH_KEYS = ("inputs", "targets", "mask", "segment_ids", "positions")


def document_layout(inputs: np.ndarray, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) of [rows, seq] inputs: a new document starts after each
    end-of-document input; segment ids count documents from 1, positions restart at 0."""
    rows, seq = inputs.shape
    starts = np.zeros(inputs.shape, bool)
    starts[:, 1:] = inputs[:, :-1] == eod_id
    segment_ids = 1 + np.cumsum(starts, axis=1)
    index = np.broadcast_to(np.arange(seq), inputs.shape)
    start_index = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return segment_ids.astype(np.int32), (index - start_index).astype(np.int32)


class PackedSequences:
    """The windows of a token file: rows of length seq holding BATCH_KEYS. `doc_mask` gives each
    document its own segment and positions (when the file marks documents)."""

    def __init__(self, tokens: TokenFile, seq: int, *, vocab_size: int | None = None, doc_mask: bool = True):
        self.tokens = tokens
        self.seq = seq
        self.vocab_size = vocab_size
        self.doc_mask = doc_mask
        self.count = max((len(tokens) - 1) // seq, 0)
        if self.count == 0:
            raise DataError(f"{tokens.path}: {len(tokens)} tokens do not fill one sequence of "
                            f"{seq} + 1 tokens")
        if vocab_size is not None and tokens.vocab_size is not None and tokens.vocab_size > vocab_size:
            raise DataError(f"{tokens.path}: its tokenizer's vocabulary ({tokens.vocab_size} ids) is larger "
                            f"than the model's ({vocab_size})")
        # One pass over the file now, so a bad id stops the run before any step or checkpoint.
        if vocab_size is not None and len(tokens) and (largest := int(tokens.tokens.max())) >= vocab_size:
            raise DataError(f"{tokens.path}: token id {largest} is outside the model's "
                            f"vocabulary of {vocab_size}")

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows `indices` as BATCH_KEYS arrays [len(indices), seq]."""
        offsets = np.asarray(indices, np.int64)[:, None] * self.seq + np.arange(self.seq + 1)
        windows = np.asarray(self.tokens.tokens[offsets.ravel()], np.int64).reshape(offsets.shape)
        if self.vocab_size is not None and windows.size and windows.max() >= self.vocab_size:
            raise DataError(f"{self.tokens.path}: token id {windows.max()} is outside the model's "
                            f"vocabulary of {self.vocab_size}")
        inputs, targets = windows[:, :-1], windows[:, 1:]
        eod_id = self.tokens.eod_id
        if eod_id is None:
            mask = np.ones(inputs.shape, bool)
        else:
            mask = inputs != eod_id
        segment_ids, positions = row_layout(inputs, eod_id, self.doc_mask)
        return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32), "mask": mask,
                "segment_ids": segment_ids, "positions": positions}


def row_layout(inputs: np.ndarray, eod_id: int | None, doc_mask: bool) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) of rows of inputs: per document where doc_mask is on and the file
    marks documents' ends, else each row one document from position 0."""
    if doc_mask and eod_id is not None:
        return document_layout(inputs, eod_id)
    return (np.ones(inputs.shape, np.int32),
            np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape))


def image_rows(length: int, offsets: np.ndarray, per_image: int, seq: int, slots: int) -> tuple[np.ndarray, ...]:
    """(starts, lengths, first_image, images) of the rows of a stream of `length` tokens whose
    images' placeholder runs start at `offsets`: row r's inputs are tokens [start, start + length)
    (at most seq), its targets one further, and it holds images first_image .. + images, whole."""
    starts, lengths, firsts, counts = [], [], [], []
    start, image = 0, 0
    while start + 1 < length:
        end = min(start + seq, length - 1)
        first = image
        while image < len(offsets) and offsets[image] < end:
            if offsets[image] + per_image > end or image - first == slots:
                end = int(offsets[image])
                break
            image += 1
        if end <= start:
            why = f"an image's {per_image} tokens do not fit rows of {seq}" if per_image > seq \
                else f"the program has {slots} image slots per row"
            raise DataError(f"token {start} starts an image run that no row can hold: {why}")
        starts.append(start), lengths.append(end - start), firsts.append(first), counts.append(image - first)
        start = end
    return tuple(np.asarray(values, np.int64) for values in (starts, lengths, firsts, counts))


class ImagePackedSequences:
    """The rows of a token file with images (the module's docstring, Images): BATCH_KEYS plus
    pixel_values and image_mask, an image always in the same row as its placeholders."""

    def __init__(self, tokens: TokenFile, images: ImageFile, seq: int, slots: int, *,
                 vocab_size: int | None = None, doc_mask: bool = True):
        PackedSequences(tokens, seq, vocab_size=vocab_size, doc_mask=doc_mask)  # its checks of the ids
        self.tokens, self.images, self.seq, self.slots, self.doc_mask = tokens, images, seq, slots, doc_mask
        self.starts, self.lengths, self.first_image, self.image_count = image_rows(
            len(tokens), images.offsets, images.tokens_per_image, seq, slots)
        self.count = len(self.starts)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, np.int64)
        starts, lengths = self.starts[indices], self.lengths[indices]
        eod_id = self.tokens.eod_id
        pad = 0 if eod_id is None else eod_id
        offsets = starts[:, None] + np.arange(self.seq + 1)
        real = np.arange(self.seq + 1)[None, :] <= lengths[:, None]
        windows = np.where(real, np.asarray(self.tokens.tokens[np.minimum(offsets, len(self.tokens) - 1).ravel()],
                                            np.int64).reshape(offsets.shape), pad)
        in_row = np.arange(self.seq)[None, :] < lengths[:, None]
        inputs, targets = np.where(in_row, windows[:, :-1], pad), windows[:, 1:]
        mask = in_row & (targets != self.images.placeholder)
        if eod_id is not None:
            mask &= inputs != eod_id
        segment_ids, positions = row_layout(inputs, eod_id, self.doc_mask)
        segment_ids, positions = np.where(in_row, segment_ids, 0), np.where(in_row, positions, 0)
        pixels = np.zeros((len(indices), self.slots, *self.images.image_shape), np.float32)
        image_mask = np.zeros((len(indices), self.slots), bool)
        tiled = self.images.aspect_ratio_ids is not None
        aspect_ratio_ids = np.zeros((len(indices), self.slots), np.int32)
        for r, (first, count) in enumerate(zip(self.first_image[indices], self.image_count[indices])):
            pixels[r, :count] = self.images.pixels[first:first + count]
            image_mask[r, :count] = True
            if tiled:
                aspect_ratio_ids[r, :count] = self.images.aspect_ratio_ids[first:first + count]
        return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32), "mask": mask,
                "segment_ids": segment_ids.astype(np.int32), "positions": positions.astype(np.int32),
                "pixel_values": pixels, "image_mask": image_mask,
                **({"aspect_ratio_ids": aspect_ratio_ids} if tiled else {})}


def packed_sequences(tokens: TokenFile, layout: BatchLayout, *, vocab_size: int | None = None,
                     doc_mask: bool = True):
    """The packer for the data and the program: images where both have them."""
    images = open_images(tokens)
    if images is None:
        return PackedSequences(tokens, layout.seq, vocab_size=vocab_size, doc_mask=doc_mask)
    if layout.images is None:
        raise DataError(f"{tokens.path} carries {len(images)} images ({images.path}); the program takes none")
    if images.image_shape != tuple(layout.images.image):
        raise DataError(f"{images.path}: images of shape {list(images.image_shape)}; the program takes "
                        f"{list(layout.images.image)}")
    return ImagePackedSequences(tokens, images, layout.seq, layout.images.slots, vocab_size=vocab_size,
                                doc_mask=doc_mask)


class ShuffledOrder:
    """Window index of the g-th window consumed: a fresh permutation per epoch, from (seed, epoch)."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._epoch, self._permutation = -1, np.empty(0, np.int64)

    def __call__(self, consumed: np.ndarray) -> np.ndarray:
        consumed = np.asarray(consumed, np.int64)
        epochs, within = np.divmod(consumed, self.count)
        out = np.empty_like(consumed)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self._permutation_of(int(epoch))[within[here]]
        return out

    def _permutation_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.count)
        return self._permutation


class SequentialOrder:
    """Windows in file order, wrapping around: for evaluation, where every run sees the same batches."""

    def __init__(self, count: int):
        self.count = count

    def __call__(self, consumed: np.ndarray) -> np.ndarray:
        return np.asarray(consumed, np.int64) % self.count


def global_batch(sequences: PackedSequences, order, layout: BatchLayout, first: int) -> dict[str, jax.Array]:
    """Windows first .. first + batch - 1 (in `order`) as sharded global arrays; this process
    reads only the rows its devices hold."""
    shape = (layout.batch, layout.seq)
    host_rows: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def rows_for(index: tuple[slice, ...]) -> dict[str, np.ndarray]:
        start, stop, _ = index[0].indices(layout.batch)
        if (start, stop) not in host_rows:  # devices that replicate a row range share one read
            host_rows[start, stop] = sequences.rows(order(np.arange(first + start, first + stop)))
        return host_rows[start, stop]

    dtypes = {"inputs": np.int32, "targets": np.int32, "mask": layout.mask_dtype,
              "segment_ids": np.int32, "positions": np.int32}
    batch = {name: jax.make_array_from_callback(
                 shape, layout.sharding,
                 lambda index, name=name: rows_for(index)[name][:, index[1]].astype(dtypes[name]))
             for name in BATCH_KEYS}
    if layout.images is not None:
        images = layout.images
        shapes = {"pixel_values": ((images.slots, *images.image), np.float32, images.pixel_sharding),
                  "image_mask": ((images.slots,), bool, images.mask_sharding)}
        if len(images.image) == 4:  # tiles, channels, height, width: each image's tile arrangement too
            shapes["aspect_ratio_ids"] = ((images.slots,), np.int32, images.mask_sharding)

        def image_rows_for(index, name):
            rows = rows_for(index)
            if name in rows:
                values = rows[name]
            else:  # a text-only file: every slot of every row empty
                start, stop, _ = index[0].indices(layout.batch)
                values = np.zeros((stop - start, *shapes[name][0]), shapes[name][1])
            return values[(slice(None),) + tuple(index[1:])]

        for name, (value_shape, _, sharding) in shapes.items():
            batch[name] = jax.make_array_from_callback((layout.batch, *value_shape), sharding,
                                                       lambda index, name=name: image_rows_for(index, name))
    return batch


class TrainData:
    """The training stream: shuffled windows, one global batch per call, and its position."""

    def __init__(self, tokens: TokenFile, layout: BatchLayout, *, seed: int, vocab_size: int | None = None,
                 doc_mask: bool = True):
        self.layout = layout
        self.sequences = packed_sequences(tokens, layout, vocab_size=vocab_size, doc_mask=doc_mask)
        self.seed = seed
        _ = tokens.fingerprint  # computed now (for a .npy), before any step, not at the first save
        self.order = ShuffledOrder(self.sequences.count, seed)
        self.consumed = 0  # windows handed out so far, over all epochs

    def next_batch(self) -> dict[str, jax.Array]:
        batch = global_batch(self.sequences, self.order, self.layout, self.consumed)
        self.consumed += self.layout.batch
        return batch

    @property
    def epoch(self) -> float:
        return self.consumed / self.sequences.count

    def position(self) -> dict:
        """What the checkpoint keeps: enough to hand out exactly the same windows next."""
        return {"consumed": self.consumed, "seed": self.seed, "windows": self.sequences.count,
                "seq": self.layout.seq, "tokens": len(self.sequences.tokens),
                "fingerprint": self.sequences.tokens.fingerprint}

    def restore(self, position: dict) -> None:
        """Continues from a saved position; refuses one taken on other data, where it would
        silently hand out other windows. A position without a fingerprint (saved before
        checkpoints recorded one) is checked on its sizes alone."""
        ours = self.position()
        path = self.sequences.tokens.path
        for key in ("windows", "seq", "tokens"):
            if position.get(key) != ours[key]:
                raise DataError(f"the checkpoint's data position was taken on other data: {key} "
                                f"{position.get(key)} there, {ours[key]} here ({path})")
        if position.get("fingerprint") is not None and position["fingerprint"] != ours["fingerprint"]:
            raise DataError(f"{path}: the checkpoint was trained on other data of the same length "
                            f"(content fingerprint {position['fingerprint'][:12]}… there, "
                            f"{ours['fingerprint'][:12]}… here)")
        self.seed = int(position["seed"])
        self.order = ShuffledOrder(self.sequences.count, self.seed)
        self.consumed = int(position["consumed"])


def eval_batches(tokens: TokenFile, layout: BatchLayout, count: int, *, vocab_size: int | None = None,
                 doc_mask: bool = True):
    """The first `count` batches of a file in order (fewer if it is short): the same every time."""
    sequences = packed_sequences(tokens, layout, vocab_size=vocab_size, doc_mask=doc_mask)
    count = max(1, min(count, sequences.count // layout.batch))
    order = SequentialOrder(sequences.count)
    for b in range(count):
        yield global_batch(sequences, order, layout, b * layout.batch)
