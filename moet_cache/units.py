"""Byte sizes: parse "4.5GiB", "96 GB", "25%", print GiB. Units are a trap: GB is 10^9, GiB is 2^30."""

from __future__ import annotations

import re

from .errors import InputError

GIB = 1 << 30
MIB = 1 << 20
_SUFFIXES = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse a byte count with an optional decimal (GB) or binary (GiB) suffix; bare numbers are bytes."""
    if isinstance(text, int):
        if text < 0:
            raise InputError(f"{what} must not be negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _SUFFIXES:
        raise InputError(
            f"cannot read {what} {text!r}",
            "write a number with an optional unit such as 4.5GiB, 96GB, 512MiB or 1000000",
        )
    value = float(m.group(1)) * _SUFFIXES[m.group(2).lower()]
    if value > 2**62:
        raise InputError(f"{what} {text!r} is too large")
    return int(round(value))


_TOKENS_RE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DEC = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BIN = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_tokens(text: str | int, *, what: str = "--max-model-len") -> int:
    """A token count as vLLM's own `human_readable_int` reads it: 128k = 128,000, 128K = 131,072, 25.6k = 25,600
    (no decimals with the binary suffixes), or a plain integer. plan and serve read contexts with this."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    t = str(text).strip()
    m = _TOKENS_RE.fullmatch(t)
    try:
        if m is None:
            return int(t)
        number, suffix = m.groups()
        if suffix in _DEC:
            return int(float(number) * _DEC[suffix])
        return int(number) * _BIN[suffix]
    except ValueError:
        raise InputError(f"cannot read {what} {text!r} as a number of tokens",
                         "write e.g. 131072, 128k (128,000) or 128K (131,072), as vLLM reads it") from None


def parse_budget(text: str, total: int, *, what: str = "budget") -> int:
    """Parse a byte budget that may also be a percentage of `total` ("25%")."""
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise InputError(f"cannot read {what} {text!r}", "write e.g. 25% or 4.5GiB") from None
        if not 0.0 <= pct <= 100.0:
            raise InputError(f"{what} {text!r} must be between 0% and 100%")
        return int(total * pct / 100.0)
    return parse_size(s, what=what)


def fmt_gib(n: float, digits: int = 2) -> str:
    """Bytes as a GiB string, always in GiB so figures never mix units."""
    return f"{n / GIB:.{digits}f} GiB"


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number readable."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
