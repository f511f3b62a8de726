"""Text in and out for `mxc generate --prompt`: a model's tokenizer directory (tokenizer.json
beside tokenizer_config.json, as HF and `mxc import-gguf` / `mxc import-hf` write them), its
chat template, and decoded text streamed as tokens arrive.

The chat template is rendered the way transformers' apply_chat_template renders it (a
sandboxed jinja2 environment with trim_blocks and lstrip_blocks, `raise_exception`, `tojson`,
`strftime_now`, the special tokens as variables) and the rendered text is tokenized without
adding special tokens, as transformers does; a plain prompt gets the tokenizer's own (BOS where
the tokenizer asks for it).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 saves the template here
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TextError(ValueError):
    """A tokenizer directory that cannot serve text, or a prompt it cannot encode."""


def _token_text(value) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken object.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TextTokenizer:
    directory: Path
    tokenizer: object  # tokenizers.Tokenizer
    config: dict  # tokenizer_config.json
    chat_template: str | None
    stop_ids: frozenset[int]  # end-of-sequence ids: generation stops at any of them

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def special(self, name: str) -> str | None:
        return _token_text(self.config.get(name))

    def chat_text(self, user_message: str) -> str:
        """The template applied to one user message, with the generation prompt after it."""
        if not self.chat_template:
            raise TextError(f"{self.directory} has no chat template (tokenizer_config.json's chat_template or "
                            f"{CHAT_TEMPLATE_FILE}); drop --chat to generate from the plain prompt")
        return render_chat(self.chat_template, [{"role": "user", "content": user_message}],
                           {name: self.special(name) for name in SPECIAL_TOKENS})

    def prompt_ids(self, prompt: str, chat: bool) -> np.ndarray:
        """The prompt as one request row, [1, length]."""
        ids = self.encode(self.chat_text(prompt), special_tokens=False) if chat else self.encode(prompt)
        if not ids:
            raise TextError("the prompt encodes to no tokens: give some text")
        return np.asarray([ids], np.int32)


def render_chat(template: str, messages: list[dict], special_tokens: dict) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        from datetime import datetime

        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                **{k: v for k, v in special_tokens.items() if v is not None})
    except jinja2.exceptions.TemplateError as err:
        raise TextError(f"the chat template fails: {err}") from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TextError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise TextError(f"{path}: not a JSON object")
    return data


def load_text_tokenizer(directory: str | Path) -> TextTokenizer:
    """The tokenizer in `directory` (or the directory of a tokenizer.json named directly)."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    if directory.is_file() and directory.name == TOKENIZER_FILE:
        directory = directory.parent
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise TextError(f"{directory} holds no {TOKENIZER_FILE} (a model directory of mxc import-gguf or "
                        "import-hf has one)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises its own exception type
        raise TextError(f"{path}: not a HuggingFace tokenizers JSON file ({err})") from None
    config = _read_json(directory / TOKENIZER_CONFIG_FILE) if (directory / TOKENIZER_CONFIG_FILE).is_file() else {}
    template = config.get("chat_template")
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        template = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    stop_ids = set()
    eos = _token_text(config.get("eos_token"))
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        stop_ids.add(tokenizer.token_to_id(eos))
    if (directory / GENERATION_CONFIG_FILE).is_file():
        ids = _read_json(directory / GENERATION_CONFIG_FILE).get("eos_token_id")
        stop_ids.update(ids if isinstance(ids, list) else [] if ids is None else [ids])
    return TextTokenizer(directory, tokenizer, config, template, frozenset(int(i) for i in stop_ids))


class StreamDecoder:
    """Incremental detokenization: the text of the ids so far, released in pieces that never end
    inside a UTF-8 character (a byte-level token may carry half of one; its text then ends in
    U+FFFD until the rest arrives) and that account for tokenizers which join words with spaces
    only in context (a piece is the difference of two decodes that share a prefix)."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is decoded already, as context for the next piece
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """What is left at the end (an incomplete character stays as U+FFFD)."""
        rest = self.tokenizer.decode(self.ids[self.prefix:])[len(self.tokenizer.decode(self.ids[self.prefix:self.read])):]
        self.prefix = self.read = len(self.ids)
        return rest


class TextStream:
    """on_tokens for runtime.generate: one request's new tokens decoded to `out` as they arrive,
    stopping at an end-of-sequence id (not printed). Every process of a job runs it, so all stop
    at the same step; only one with `silent` False prints."""

    def __init__(self, tokenizer: TextTokenizer, out: TextIO | None = None):
        self.tokenizer = tokenizer
        self.decoder = StreamDecoder(tokenizer)
        self.out = out
        self.silent = False

    def _write(self, text: str) -> None:
        if not self.silent and text:
            out = self.out or sys.stdout
            out.write(text)
            out.flush()

    def on_tokens(self, requests: np.ndarray, tokens: np.ndarray) -> bool:
        for token in tokens.tolist():
            if token in self.tokenizer.stop_ids:
                return True
            self._write(self.decoder.push(token))
        return False

    def finish(self) -> None:
        self._write(self.decoder.flush() + "\n")


def generation_inputs(args, default_tokenizer: str | Path | None = None) -> tuple[np.ndarray, TextStream | None]:
    """The prompt rows of `mxc generate`'s flags (add_generation_arguments) and, for a text prompt,
    the stream that prints the answer; the tokenizer is --tokenizer, else `default_tokenizer`."""
    from mxc.runtime.prompt_file import PromptFileError, read_prompt_array

    if args.prompt is None:
        for flag, given in (("--chat", args.chat), ("--tokenizer", args.tokenizer)):
            if given:
                raise TextError(f"{flag} goes with a text --prompt, not --prompt-tokens")
        if not args.output:
            raise TextError("--prompt-tokens writes its tokens to -o/--output TOKENS.npy: name the file")
        try:
            return read_prompt_array(args.prompt_tokens, "--prompt-tokens"), None
        except PromptFileError as err:
            raise TextError(str(err)) from None
    directory = args.tokenizer or default_tokenizer
    if directory is None:
        raise TextError("a text --prompt needs the model's tokenizer: --tokenizer DIR (the directory of its "
                        "tokenizer.json, e.g. the model directory of mxc import-gguf)")
    tokenizer = load_text_tokenizer(directory)
    return tokenizer.prompt_ids(args.prompt, args.chat), TextStream(tokenizer)
