"""Text to syntax tree. LALR with a contextual lexer: fast, and an error names the exact token."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

import lark
from lark import Lark, Token, Transformer, v_args

from mxc.spec import ast
from mxc.spec.diagnostics import Diagnostic, Loc, SpecError
from mxc.spec.resolve import did_you_mean

# How a terminal reads in an error message.
_TERMINAL_WORDS = {
    "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'",
    "COMMA": "','", "EQUAL": "'='", "DOT": "'.'", "MINUS": "'-'", "__ANON_0": "'->'",
    "NAME": "a name", "MODEL_NAME": "a model name", "NUMBER": "a number", "INT": "an integer",
    "STRING": "a string", "MODEL": "'model'", "EXTENDS": "'extends'", "LET": "'let'",
    "BLOCK": "'block'", "X": "'x'", "SHARD": "'shard'", "MESH": "'mesh'", "LAYERS": "'layers'",
    "$END": "end of file",
}


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("mxc.spec").joinpath("mspec.lark").read_text()
    # No cache=True: lark would unpickle its tables from the shared temp folder.
    return Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=True)


def _loc(path: str, tok) -> Loc:
    meta = tok if isinstance(tok, Token) else tok
    return Loc(path, meta.line, meta.column, meta.end_column, meta.end_line)


class _ToAst(Transformer):
    def __init__(self, path: str, text: str):
        super().__init__()
        self.filename = path
        self.text = text
        self.problems: list[Diagnostic] = []  # well-formed but meaningless text, e.g. `x 0`

    def _open_line(self, meta) -> int:
        """The line of a statement's `{`: the first one after its keyword outside a comment."""
        pos = meta.start_pos
        while self.text[pos] != "{":
            pos = self.text.index("\n", pos) if self.text[pos] == "#" else pos + 1
        return self.text.count("\n", 0, pos) + 1

    def _l(self, item) -> Loc:
        return _loc(self.filename, item)

    def _m(self, meta) -> Loc:
        return Loc(self.filename, meta.line, meta.column, meta.end_column, meta.end_line)

    @v_args(meta=True)
    def start(self, meta, items):
        return list(items)

    @v_args(meta=True)
    def model(self, meta, items):
        name, parent, *body = items
        return ast.Model(str(name), str(parent) if parent else None, tuple(body), self._l(name),
                         self._l(parent) if parent else None, meta.end_line,
                         start_line=meta.line, open_line=self._open_line(meta))

    @v_args(meta=True)
    def let(self, meta, items):
        name, value = items
        return ast.Let(str(name), value, self._m(meta))

    @v_args(meta=True)
    def assign(self, meta, items):
        path, value = items
        path_names, path_loc = path
        return ast.Assign(path_names, value, Loc(self.filename, path_loc.line, path_loc.col,
                                                 path_loc.end_col, meta.end_line))

    @v_args(meta=True)
    def path(self, meta, names):
        return tuple(str(n) for n in names), self._m(meta)

    @v_args(meta=True)
    def block(self, meta, items):
        name, repeat, *body = items
        count, count_loc = repeat if repeat else (None, None)
        where = self._l(name) if name else Loc(self.filename, meta.line, meta.column, meta.column + 5,
                                                meta.end_line)
        where = Loc(where.path, where.line, where.col, where.end_col, meta.end_line)
        return ast.Block(str(name) if name else None, count, tuple(body), where, count_loc,
                         start_line=meta.line, open_line=self._open_line(meta))

    def repeat(self, items):
        (tok,) = items
        count = int(str(tok).replace("_", ""))
        if count < 1:  # `x 0` would otherwise read as "once" in layers, or fail far from the count
            self.problems.append(Diagnostic(self._l(tok), f"a repeat count must be at least 1, not {count}",
                                            "remove the entry, or repeat it 1 or more times"))
        return count, self._l(tok)

    @v_args(meta=True)
    def shard(self, meta, rules):
        return ast.Shard(tuple(rules), self._m(meta), open_line=self._open_line(meta))

    @v_args(meta=True)
    def rule(self, meta, items):
        name, (axes, tuple_form, locs) = items
        return ast.Rule(str(name), axes, tuple_form, self._l(name), locs, end_line=meta.end_line)

    def one_axis(self, items):
        (tok,) = items
        return (str(tok),), False, (self._l(tok),)

    def axis_tuple(self, items):
        toks = [t for t in items if t is not None]
        return tuple(str(t) for t in toks), True, tuple(self._l(t) for t in toks)

    @v_args(meta=True)
    def mesh(self, meta, sizes):
        return ast.Mesh(tuple(sizes), self._m(meta), open_line=self._open_line(meta))

    @v_args(meta=True)
    def layers(self, meta, segments):
        return ast.Layers(tuple(segments), self._m(meta))

    @v_args(meta=True)
    def kind_segment(self, meta, items):
        name, repeat = items
        return ast.Segment(str(name), (), repeat[0] if repeat else None, self._m(meta))

    @v_args(meta=True)
    def group_segment(self, meta, items):
        *children, repeat = items
        return ast.Segment(None, tuple(children), repeat[0], self._m(meta))

    def number(self, items):
        (tok,) = items
        return ast.Number(str(tok), self._l(tok))

    def negative(self, items):
        (tok,) = items
        loc = self._l(tok)
        return ast.Number("-" + str(tok), Loc(loc.path, loc.line, loc.col - 1, loc.end_col))

    def string(self, items):
        (tok,) = items
        return ast.String(str(tok), self._l(tok))

    def name(self, items):
        (tok,) = items
        return ast.Name(str(tok), self._l(tok))

    @v_args(meta=True)
    def list(self, meta, items):
        return ast.ListValue(tuple(i for i in items if i is not None), self._m(meta))

    @v_args(meta=True)
    def call(self, meta, items):
        kind, *args = items
        return ast.Call(str(kind), tuple(a for a in args if a is not None), self._m(meta))

    @v_args(meta=True)
    def arg(self, meta, items):
        name, value = items
        return ast.Arg(str(name), value, self._l(name))


def _describe(expected: set[str]) -> str:
    words = sorted({_TERMINAL_WORDS.get(t, t.lower()) for t in expected})
    if len(words) > 6:
        words = words[:6] + ["..."]
    return ", ".join(words)


# Statements that open a line; one lexed as a plain name means it sits inside the wrong braces.
_STATEMENT_WORDS = ("model", "block", "shard", "mesh", "layers", "let")
_CLOSERS = {"{": "}", "(": ")", "[": "]"}


def _unclosed(text: str, end: int) -> list[tuple[str, int, int]]:
    """Brackets opened before offset `end` and not closed by then: (char, line, col), outermost first."""
    stack: list[tuple[str, int, int]] = []
    line, col, i = 1, 1, 0
    while i < min(end, len(text)):
        char = text[i]
        if char == "#":  # a comment runs to the end of the line
            while i < end and i < len(text) and text[i] != "\n":
                i += 1
            continue
        if char == '"':  # strings never span lines and may hold brackets
            j = i + 1
            while j < len(text) and text[j] not in '"\n':
                j += 2 if text[j] == "\\" and text[j + 1:j + 2] not in ("", "\n") else 1
            j += 1 if text[j:j + 1] == '"' else 0
            col += j - i
            i = j
            continue
        if char in _CLOSERS:
            stack.append((char, line, col))
        elif stack and char == _CLOSERS[stack[-1][0]]:
            stack.pop()
        if char == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1
    return stack


def _never_closed(text: str, end: int) -> str | None:
    stack = _unclosed(text, end)
    if not stack:
        return None
    char, line, col = stack[-1]
    return f"the '{char}' on line {line}, column {col} is never closed"


def _misplaced_statement(path: str, text: str, tok: Token) -> Diagnostic | None:
    """`block ...` (or `model`, `shard`, ...) where only fields may stand: usually a missing '}'.

    The statement's keyword is either the unexpected token itself or, lexed as a plain name,
    the word just before it at the start of its line."""
    line_start = text.rfind("\n", 0, tok.start_pos) + 1
    before = text[line_start:tok.start_pos].strip()
    if not before and str(tok) in _STATEMENT_WORDS:
        word, col = str(tok), tok.column
    elif before in _STATEMENT_WORDS:
        word, col = before, text.index(before, line_start) - line_start + 1
    else:
        return None
    stack = [b for b in _unclosed(text, line_start) if b[0] == "{"]
    if not stack:
        return None
    _, open_line, open_col = stack[-1]
    return Diagnostic(Loc(path, tok.line, col, col + len(word)), f"'{word}' cannot appear here",
                      f"is a '}}' missing before it? The '{{' on line {open_line}, column {open_col} "
                      "is still open")


_NAME_BEFORE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t\r\n]*$")


def _stray_name(path: str, text: str, tok: Token, expected) -> Diagnostic | None:
    """A name that began a statement which never got its '=': the mistake is the name, not the
    token after it. `blok x 2 {` is a misspelt `block`; `layers = local global` lacks a ','."""
    if not set(expected) <= {"DOT", "EQUAL"}:
        return None
    found = _NAME_BEFORE.search(text, 0, tok.start_pos)
    if found is None:
        return None
    word, start = found[1], found.start(1)
    line_start = text.rfind("\n", 0, start) + 1
    line, col = text.count("\n", 0, start) + 1, start - line_start + 1
    where = Loc(path, line, col, col + len(word))
    keyword = did_you_mean(word, _STATEMENT_WORDS)
    if keyword and text[line_start:start].strip() == "":
        return Diagnostic(where, f"unknown statement '{word}'", keyword)
    if line < tok.line:  # the name ends its line, so the statement before it took it as its own end
        statement = text[line_start:start].split()
        hint = ("separate the layer kinds with ','" if statement[:1] == ["layers"]
                else "a field is set as NAME = VALUE")
        return Diagnostic(where, f"unexpected name '{word}'", hint)
    return None


def _token_words(tok: Token) -> str:
    word = _TERMINAL_WORDS.get(tok.type)
    if word is None or word.startswith("'"):  # punctuation and keywords: the text says it all
        return repr(str(tok))
    # "unexpected name 'x'", not "unexpected a name 'x'"
    return f"{word.removeprefix('a ').removeprefix('an ')} {str(tok)!r}"


def _end_of_text(text: str) -> tuple[int, int]:
    """(line, col) just after the last thing written: where an unexpected end of file is shown.
    Only a newline ends a line, as the lexer counts them."""
    end = len(text.rstrip())
    line_start = text.rfind("\n", 0, end) + 1
    return text.count("\n", 0, end) + 1, end - line_start + 1


def _syntax_error(path: str, text: str, err: lark.exceptions.UnexpectedInput) -> Diagnostic:
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        char = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
        return Diagnostic(Loc(path, err.line, err.column, err.column + 1),
                          f"unexpected character {char!r}")
    if isinstance(err, lark.exceptions.UnexpectedToken):
        tok = err.token
        if tok.type == "$END":
            line, col = _end_of_text(text)
            return Diagnostic(Loc(path, line, col, col + 1),
                              f"unexpected end of file; expected {_describe(err.expected)}",
                              _never_closed(text, len(text))
                              or "a '{' or '(' may be missing its closing partner")
        misplaced = _misplaced_statement(path, text, tok) or _stray_name(path, text, tok, err.expected)
        if misplaced is not None:
            return misplaced
        return Diagnostic(Loc(path, tok.line, tok.column, tok.end_column),
                          f"unexpected {_token_words(tok)}; expected {_describe(err.expected)}")
    if isinstance(err, lark.exceptions.UnexpectedEOF):
        line, col = _end_of_text(text)
        return Diagnostic(Loc(path, line, col, col + 1),
                          f"unexpected end of file; expected {_describe(set(err.expected))}",
                          _never_closed(text, len(text)))
    return Diagnostic(Loc(path, getattr(err, "line", 1), getattr(err, "column", 1)), str(err))


def parse(text: str, path: str = "<text>") -> ast.File:
    """Parse one file; raise SpecError with a located diagnostic on a syntax error."""
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as err:
        raise SpecError([_syntax_error(path, text, err)], {path: text}) from None
    to_ast = _ToAst(path, text)
    items = to_ast.transform(tree)
    if to_ast.problems:
        raise SpecError(to_ast.problems, {path: text})
    return ast.File(path, tuple(items), tuple(_comments(text)))


def _comments(text: str) -> list[ast.Comment]:
    """Comments with their positions, for the formatter (strings never span lines)."""
    found = []
    # Lines as the lexer counts them: only "\n" ends one (splitlines would also split at \x0c, \u2028...).
    for number, line in enumerate(text.split("\n"), start=1):
        in_string = escaped = False
        for col, char in enumerate(line, start=1):
            if in_string:
                if char == '"' and not escaped:
                    in_string = False
                escaped = char == "\\" and not escaped
            elif char == '"':
                in_string = True
            elif char == "#":
                found.append(ast.Comment(line[col - 1:].rstrip(), number, col))
                break
    return found
