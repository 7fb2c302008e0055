"""Argument checks shared by the moe_compile custom ops (errors start with the op's name), and their
device-side asserts."""
from __future__ import annotations


def check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"moe_compile.{op}: {msg}")


# CUDA's device-side assert takes messages of at most 254 characters (longer: "Message length must be
# smaller than 255" when the assert is issued); the CPU takes any length, so CPU tests would not see it
DEVICE_ASSERT_MAX_CHARS = 254


def device_assert(cond, msg: str) -> None:
    """``torch._assert_async(cond, msg)``: checked on the device, no host sync; ``msg`` checked against
    CUDA's limit on every device, so a message too long fails on the CPU too."""
    import torch

    if len(msg) > DEVICE_ASSERT_MAX_CHARS:
        raise ValueError(f"device_assert: message of {len(msg)} characters, CUDA takes at most "
                         f"{DEVICE_ASSERT_MAX_CHARS}: {msg[:80]}...")
    torch._assert_async(cond, msg)
