"""Argument checks shared by the moe_compile custom ops: errors start with the op's name."""
from __future__ import annotations


def check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"moe_compile.{op}: {msg}")
