"""Kubernetes resource quantities written the way the API server stores them.

The API server keeps a quantity in its canonical form (`1.5Gi` is stored as `1536Mi`, `0.5` as
`500m`, `2000` as `2k`). plan.py compares what we render with what is stored, string for string,
so a quantity rendered as the user spelled it would differ on every pass and be patched forever.
This is apimachinery's Quantity.CanonicalizeBytes, for the positive values a spec holds."""
from __future__ import annotations

import re
from decimal import ROUND_UP, Decimal, localcontext

from kubernetes.utils import parse_quantity

DECIMAL_SUFFIXES = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
BINARY_SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
EXPONENT = re.compile(r"[eE][-+]?[0-9]+$")


def canonical(quantity: str | int) -> str:
    """`quantity` as the API server would store it."""
    text = str(quantity)
    with localcontext(prec=64):  # exact for any quantity the CRD lets through (64 characters)
        value = Decimal(parse_quantity(text)).quantize(Decimal("1e-9"), rounding=ROUND_UP)  # nanos, rounded up
        if value == 0:
            return "0"
        # 2^10-multiples stay binary (`Mi`, `Gi`); below 1024 or with a fraction they become decimal.
        if text.endswith("i") and value >= 1024 and value == value.to_integral_value():
            number, power = int(value), 0
            while number % 1024 == 0 and power < len(BINARY_SUFFIXES) - 1:
                number, power = number // 1024, power + 1
            return f"{number}{BINARY_SUFFIXES[power]}"
        # Decimal: an integer times 10^e with e a multiple of 3, as `m`/`k`/`M`..., or as `e<N>`
        # when that is how the quantity was written.
        _, digits, exponent = value.normalize().as_tuple()
        assert isinstance(exponent, int)  # a finite value
        shift = exponent % 3
        mantissa, exponent = int("".join(map(str, digits))) * 10 ** shift, exponent - shift
    if EXPONENT.search(text):
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    return f"{mantissa}{DECIMAL_SUFFIXES.get(exponent, f'e{exponent}')}"
