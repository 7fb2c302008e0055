"""Graph rewrites: the only code in moe_compile that mutates FX graphs."""
