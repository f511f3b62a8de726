"""Numbers for people: 8.03B parameters, 48.2 GFLOP, 1.5 GiB, 18.3 ms, 221M tokens/s.

The one place where mxc picks the unit of a number it prints: each value gets the unit that
keeps it readable (never `0.00 GiB` beside `6.22 MiB`, nor `2.17e-06 s`)."""

from __future__ import annotations

_COUNT = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
_SI = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))
_BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _scaled(value: float, table, separator: str) -> str | None:
    """Three significant digits, as parameter counts are quoted (8.03B, 70.6B, 405B)."""
    for size, unit in table:
        # Rounded before the comparison, so that 999.6M carries into 1B.
        scaled = float(f"{value / size:.3g}")
        if abs(scaled) >= 1:
            # Beyond the largest unit .3g would switch to exponent notation.
            digits = f"{scaled:.3g}" if abs(scaled) < 1000 else f"{scaled:.0f}"
            return f"{digits}{separator}{unit}"
    return None


def count(value: int) -> str:
    """A parameter or token count: 8030261248 -> '8.03B'; below a thousand, exact."""
    return _scaled(value, _COUNT, "") or str(value)


def flops(value: float) -> str:
    """A FLOP count: 4.82e10 -> '48.2 GFLOP'."""
    return (_scaled(value, _SI, " ") or f"{value:.3g} ") + "FLOP"


def size_bytes(value: float) -> str:
    """A memory size in binary units: 1610612736 -> '1.5 GiB', 6521856 -> '6.22 MiB'."""
    return _scaled(value, _BINARY, " ") or f"{value:.0f} B"


def size_in(value: float, unit: str = "GiB", decimals: int = 2) -> str:
    """A size in a fixed binary unit, for a table column whose values must compare at a glance
    (HBM 95.00 beside usable 95.73): 102005473280 -> '95.00'."""
    return f"{value / dict((u, s) for s, u in _BINARY)[unit]:.{decimals}f}"


_DURATION = ((3600, "h"), (60, "min"), (1, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))


def duration(seconds: float) -> str:
    """A time in the unit that keeps it readable, three significant digits: 2.17e-06 -> '2.17 us',
    0.0183 -> '18.3 ms', 5400 -> '1.5 h'."""
    if seconds == 0:
        return "0 s"
    # Minutes and hours only past a minute: 90 s reads better than 1.5 min.
    table = _DURATION if abs(seconds) >= 60 else _DURATION[2:]
    return _scaled(seconds, table, " ") or f"{seconds * 1e9:.3g} ns"


def rate(value: float, unit: str) -> str:
    """A throughput: rate(2.21e8, 'tokens/s') -> '221M tokens/s'."""
    return f"{_scaled(value, _COUNT, '') or f'{value:.3g}'} {unit}"
