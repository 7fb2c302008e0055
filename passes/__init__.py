"""FX matchers: find MoE regions and check their legality. They never mutate a graph."""
