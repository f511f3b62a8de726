"""A GGUF file's tokenizer as HuggingFace `tokenizers` files: tokenizer.json and
tokenizer_config.json (special tokens, BOS/EOS flags and the chat template, as HF writes them).

GGUF stores the vocabulary, merges, token types and special ids under llama.cpp's keys
(tokenizer.ggml.*). Two kinds are imported:
- `gpt2`: byte-level BPE. Text is split by the pre-tokenizer regex llama.cpp uses for the
  file's `tokenizer.ggml.pre` (SPLITS), then mapped to the byte alphabet of GPT-2.
- `llama`: sentencepiece-style BPE with byte fallback and a `▁` word prefix; merges are taken
  from the file, or derived from the scores when it has none (as transformers does). Gemma's
  files are read as transformers' GemmaTokenizer reads them (no word prefix; merges in file order).
Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both stay whole in text.
"""

from __future__ import annotations

import json
from pathlib import Path

from mxc.compiler.gguf.file import GGUFError, GGUFFile
from mxc.runtime.text_generation import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
CONTROL, USER_DEFINED = 3, 4
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_SPLIT = None  # ByteLevel's own regex, GPT-2's
DIGITS_THEN_GPT2 = "digits"  # each digit alone, then GPT-2's regex (SmolLM's tokenizer.json)
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's llama-vocab.cpp).
SPLITS = {
    "default": GPT2_SPLIT, "gpt2": GPT2_SPLIT, "gpt-2": GPT2_SPLIT,
    "smollm": DIGITS_THEN_GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest for code points from 256."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes)))


def _field(gguf: GGUFFile, key: str, default=None):
    return gguf.metadata.get(f"tokenizer.ggml.{key}", default)


def build_tokenizer(gguf: GGUFFile):
    """The `tokenizers.Tokenizer` the file describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    kind = _field(gguf, "model")
    tokens = _field(gguf, "tokens")
    if not tokens:
        raise GGUFError(f"{gguf.path}: no tokenizer.ggml.tokens; the file holds no tokenizer")
    types = _field(gguf, "token_type") or [1] * len(tokens)
    if kind == "gpt2":
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in _field(gguf, "merges") or []]
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False))
        tokenizer.pre_tokenizer = _byte_level_split(gguf)
        tokenizer.decoder = decoders.ByteLevel()
        special_ok = lambda token: set(token) <= alphabet  # noqa: E731 -- a mislabelled control token is skipped
    elif kind == "llama" and gguf.architecture in GEMMA_ARCHITECTURES:
        tokenizer = _gemma_tokenizer(gguf, tokens)
        special_ok = lambda token: True  # noqa: E731
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = ([tuple(m.split(" ", 1)) for m in _field(gguf, "merges")] if _field(gguf, "merges")
                  else _merges_from_scores(tokens, _field(gguf, "scores") or [0.0] * len(tokens)))
        unk = _field(gguf, "unknown_token_id")
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
                                  unk_token=tokens[unk] if unk is not None else None))
        prefix = bool(_field(gguf, "add_space_prefix", True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix
                                                           else "never", split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
        tokenizer.decoder = decoders.Sequence(steps)
        special_ok = lambda token: True  # noqa: E731
    else:
        raise GGUFError(f"{gguf.path}: tokenizer model '{kind}' is not imported; mxc imports gpt2 (byte-level "
                        "BPE) and llama (sentencepiece-style BPE)")
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind_ in zip(tokens, types) if kind_ == CONTROL and special_ok(t)]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED])
    processor = _post_processor(gguf, tokens, processors)
    if processor is not None:
        tokenizer.post_processor = processor
    return tokenizer


def _gemma_tokenizer(gguf: GGUFFile, tokens: list[str]):
    """Gemma's sentencepiece vocabulary (as transformers' GemmaTokenizer and GGUF loader build it):
    spaces become `▁` with no word prefix added; a token of only spaces is stored with real spaces
    and respelled; merges, when the file has none, follow the tokens' order in the file (Gemma's
    scores do not follow its merge order)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = ([tuple(m.split(" ", 1)) for m in _field(gguf, "merges")] if _field(gguf, "merges")
              else _merges_from_scores(tokens, [-float(i) for i in range(len(tokens))]))
    unk = _field(gguf, "unknown_token_id")
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
                              unk_token=tokens[unk] if unk is not None else None))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _byte_level_split(gguf: GGUFFile):
    from tokenizers import Regex, pre_tokenizers

    pre = _field(gguf, "pre", "default")
    if pre not in SPLITS:
        raise GGUFError(f"{gguf.path}: pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not imported; mxc knows "
                        f"{', '.join(SPLITS)}")
    split = SPLITS[pre]
    if split is GPT2_SPLIT:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split == DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _post_processor(gguf: GGUFFile, tokens: list[str], processors):
    """BOS before (and EOS after) each text, where the file asks for them."""
    add_bos = _add_bos(gguf)
    add_eos = bool(_field(gguf, "add_eos_token", False))
    if not (add_bos or add_eos):
        return None
    bos, eos = _field(gguf, "bos_token_id"), _field(gguf, "eos_token_id")
    single, pair, special = ["$A"], ["$A", "$B"], []
    if add_bos and bos is not None:
        single, pair = [tokens[bos], *single], [tokens[bos], "$A", tokens[bos], "$B"]
        special.append((tokens[bos], bos))
    if add_eos and eos is not None:
        single.append(tokens[eos])
        special.append((tokens[eos], eos))
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=list(dict.fromkeys(special)))


def _add_bos(gguf: GGUFFile) -> bool:
    # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
    return bool(_field(gguf, "add_bos_token", _field(gguf, "model") == "llama"))


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a token into two tokens,
    best-scored merged token first (transformers' generate_merges)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def tokenizer_config(gguf: GGUFFile) -> dict:
    """tokenizer_config.json: what transformers' AutoTokenizer and our generate read beside tokenizer.json."""
    tokens = _field(gguf, "tokens")
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": _add_bos(gguf),
                    "add_eos_token": bool(_field(gguf, "add_eos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = _field(gguf, key)
        if index is not None and 0 <= index < len(tokens):
            config[name] = tokens[index]
    template = gguf.metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def has_tokenizer(gguf: GGUFFile) -> bool:
    return bool(_field(gguf, "tokens"))


def write_tokenizer(tokenizer, config: dict, out_dir: Path) -> None:
    """DIR/tokenizer.json and DIR/tokenizer_config.json (from build_tokenizer and tokenizer_config)."""
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
