"""Byte sizes and dtypes: parsing "94.97 GiB", printing bytes, dtype widths. No torch import."""

from __future__ import annotations

import re

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# NOTE [Size bound]: no device or tensor in this project comes near an exbibyte; a larger figure is a typo (or a
# fuzzer), and refusing it keeps every later sum an ordinary number instead of an OverflowError or inf.
MAX_BYTES = 2**60

# bytes per element; names as torch spells them (torch.bfloat16 -> "bfloat16")
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1,
    "handle": 0,   # not a tensor: a forward's `taps`, through which hook_capture nodes ask for layer outputs
}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32", "double": "float64", "fp64": "float64", "long": "int64"}


def parse_bytes(text: str | int) -> int:
    """'94.97 GiB' -> 101973894430. Raises ValueError with the accepted units."""
    if isinstance(text, bool):
        raise ValueError(f"expected a size such as '94.97 GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return _bounded(text, text)
    text = str(text)
    m = _SIZE_RE.match(text) if len(text) <= 64 else None
    if not m or m.group(2).lower() not in _UNITS | {"": 1}:
        shown = text if len(text) <= 64 else text[:40] + f"... ({len(text)} characters)"
        raise ValueError(f"expected a size such as '94.97 GiB' or '512 MiB' (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), got {shown!r}")
    whole, _, frac = m.group(1).partition(".")
    if len(whole.lstrip("0")) > 19:   # > 10**19 of any unit is over the bound; never build an inf float
        return _bounded(10**20, text)
    return _bounded(int(round(float(m.group(1)) * _UNITS.get(m.group(2).lower(), 1))), text)


def _bounded(n: int, text: object) -> int:
    if n > MAX_BYTES:
        raise ValueError(f"size {str(text)[:40]!r} is over the bound of 1 EiB (2**60 bytes)")
    return n


def fmt_bytes(n: int | float) -> str:
    """Human size in binary units, as PyTorch's OOM message prints them (GiB with 2 decimals)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def canonical_dtype(name: str) -> str:
    name = str(name).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(sorted(DTYPE_BYTES))}")
    return name


_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kMGTP]?)FLOP/s\s*$")
_RATE_PREFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def parse_rate(text: str) -> float:
    """'400 TFLOP/s' -> 4e14 FLOP/s. Raises ValueError naming the accepted form."""
    m = _RATE_RE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"expected a positive compute rate such as '400 TFLOP/s' or '60 GFLOP/s', got {text!r}")
    return float(m.group(1)) * _RATE_PREFIX[m.group(2)]


_BW_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kMGT]?)(i?)B/s\s*$")
_BW_PREFIX = {"": 0, "k": 1, "M": 2, "G": 3, "T": 4}


def parse_bandwidth(text: str) -> float:
    """'450 GB/s' -> 4.5e11 bytes/s ('GiB/s': powers of 1024). Raises ValueError naming the accepted form."""
    m = _BW_RE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"expected a positive link bandwidth such as '450 GB/s' or '50 GB/s', got {text!r}")
    return float(m.group(1)) * (1024 if m.group(3) else 1000) ** _BW_PREFIX[m.group(2)]


def fmt_bandwidth(bps: float) -> str:
    for unit, k in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6)):
        if bps >= k:
            return f"{bps / k:g} {unit}"
    return f"{bps:g} B/s"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"
