"""Placeholder: the ordered pass driver (filled in next)."""
PASS_NAMES = ("moe_regions",)
