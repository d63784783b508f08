# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Sizes for people: the one byte formatter of messages, progress lines and the preview."""
from __future__ import annotations


def human_bytes(num) -> str:
    """1536 -> '1.5 KiB' (binary units, what df -h prints); a negative size keeps its sign."""
    num = float(num)
    sign = "-" if num < 0 else ""
    num = abs(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if num < 1024 or unit == "PiB":
            return "%s%d %s" % (sign, num, unit) if unit == "B" else "%s%.1f %s" % (sign, num, unit)
        num /= 1024.0
    return "%s%.1f PiB" % (sign, num)  # pragma: no cover
