"""Errors as values: a location, a message and a hint, rendered once by the CLI."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """A span in a source file; lines and columns count from 1."""

    path: str
    line: int
    col: int
    end_col: int | None = None
    end_line: int | None = None


@dataclass(frozen=True)
class Diagnostic:
    loc: Loc
    message: str
    hint: str | None = None

    def to_json(self) -> dict:
        """The fields an editor or CI needs; end_line/end_column are null where unknown."""
        return {"file": self.loc.path, "line": self.loc.line, "column": self.loc.col,
                "end_line": self.loc.end_line or (self.loc.line if self.loc.end_col else None),
                "end_column": self.loc.end_col, "severity": "error", "message": self.message,
                "hint": self.hint}

    def render(self, source: str | None) -> str:
        head = f"{self.loc.path}:{self.loc.line}:{self.loc.col}: error: {self.message}"
        lines = [head]
        if source is not None:
            # Lines end at "\n" only, as the lexer counts them (splitlines also splits at \x0c...).
            text = source.split("\n")
            if 1 <= self.loc.line <= len(text):
                line = text[self.loc.line - 1].rstrip("\r").expandtabs(1)
                # A control character would garble the terminal; one placeholder keeps the caret aligned.
                line = "".join(c if c.isprintable() else "\ufffd" for c in line)
                width = 1
                if self.loc.end_col and self.loc.end_col > self.loc.col:
                    width = self.loc.end_col - self.loc.col
                lines.append(f"  {line}")
                lines.append("  " + " " * (self.loc.col - 1) + "^" + "~" * (width - 1))
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


class SpecError(Exception):
    """One or more diagnostics from one source text."""

    def __init__(self, diagnostics: list[Diagnostic], sources: dict[str, str] | None = None):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.loc.path, d.loc.line, d.loc.col))
        self.sources = sources or {}
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render(self.sources.get(d.loc.path)) for d in self.diagnostics)
