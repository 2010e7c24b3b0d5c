"""CRC-32C, the checksum of every item, file and attachment of a checkpoint.

:func:`crc32c_of` runs over buffers (hardware-accelerated, releasing the GIL).
:func:`crc32c_combine` gives the CRC of ``a + b`` from ``crc(a)``, ``crc(b)`` and
``len(b)``: a writer checksums each item once and still records the whole file's CRC,
instead of running the checksum twice over the bytes. Same algorithm as zlib's
``crc32_combine`` (multiplication by ``x^(8n)`` modulo the polynomial), with the Castagnoli
polynomial.
"""

from __future__ import annotations

from typing import Any, Iterable

import crc32c as _crc32c

__all__ = ["crc32c_of", "crc32c_combine"]


def crc32c_of(buffers: Iterable[Any], value: int = 0) -> int:
    """CRC32C over the concatenation of ``buffers`` (bytes-like), continuing from ``value``."""
    for buf in buffers:
        value = _crc32c.crc32c(buf, value)
    return value

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the polynomial, bit-reflected."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _powers() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _powers()  # x^(2^k) mod p


def _x8nmodp(n: int) -> int:
    xp, k = 1 << 31, 3  # x^0; start at x^(2^3) = x^8 per byte
    while n:
        if n & 1:
            xp = _multmodp(_X2N[k & 31], xp)
        n >>= 1
        k += 1
    return xp


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of the concatenation, given the CRCs of both parts and the second's length."""
    if len2 == 0:
        return crc1
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2
