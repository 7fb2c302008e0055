"""Model FLOPs of one training step (forward + backward) of a Hugging Face MoE causal LM, counted the
way NVIDIA NeMo Automodel counts them, so that "model TFLOP/s" compares with its published numbers.

Source: NeMo Automodel, ``nemo_automodel/components/utils/flops_utils.py``
(https://github.com/NVIDIA-NeMo/Automodel, read at commit 032a69ae6ef9fb0122b9d1c178f9ad2cb8998793):
``qwen3_flops``, ``mixtral_flops``, ``deepseekv3_flops`` and ``gpt_oss_flops``, dispatched on the config
class name as its ``get_flops_formula_for_hf_config`` does. Re-implemented here (same terms, same
conventions), not copied. The conventions, common to all four:

- 3 x 2 x m x n x k per GEMM (forward, data gradient, weight gradient);
- only the routed top-k experts of each token count (``num_experts_per_tok``), plus shared experts
  where the formula has them (DeepSeek-V3); the router GEMM is not counted;
- causal attention counts half of the S x S score and value products (GPT-OSS's sliding layers:
  the window's non-zero entries, window 128, every other layer);
- the LM head (vocabulary projection) counts; the embedding lookup, norms and activations do not.

Known quirks kept on purpose (they are Automodel's): GPT-OSS uses ``hidden_size // num_attention_heads``
as the head width (45 for GPT-OSS-20B, whose heads are 64 wide); DeepSeek-V3 counts one shared expert
of ``moe_intermediate_size`` whatever ``n_shared_experts`` says; Mixtral uses ``intermediate_size``.

    flops = model_flops(config, batch=2, seq_len=4096)     # per optimizer step, all of the batch
    tflops = flops / step_seconds / 1e12
"""
from __future__ import annotations


def _get(config, name, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def qwen3(config, batch: int, seq: int) -> float:
    """Automodel ``qwen3_flops`` (Qwen3MoeConfig): GQA attention, SwiGLU experts x top-k, vocab."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    groups = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "head_dim", h // heads)
    q_ratio = head_dim * heads / h
    topk = _get(config, "num_experts_per_tok", 1)
    ffn = _get(config, "moe_intermediate_size", config.intermediate_size)
    attention = 6 * batch * layers * seq * h * h * q_ratio * (
        (groups / heads * 2 + 1) + (seq / h * 2 * 0.5) + 1)          # QKV, causal scores + values, out proj
    mlp = 6 * batch * layers * seq * h * 3 * ffn * topk               # gate, up, down of each routed expert
    vocab = 6 * batch * seq * h * config.vocab_size
    return attention + mlp + vocab


def mixtral(config, batch: int, seq: int) -> float:
    """Automodel ``mixtral_flops``: the Llama formula with the FFN term times top-k."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    groups = _get(config, "num_key_value_heads", heads)
    topk = _get(config, "num_experts_per_tok", 2)
    return batch * seq * layers * h * h * (
        12 + 12 * groups / heads + 18 * topk * config.intermediate_size / h
        + 12 * seq / h * 0.5 + 6 * config.vocab_size / (layers * h))


def deepseek_v3(config, batch: int, seq: int) -> float:
    """Automodel ``deepseekv3_flops``: MLA projections, causal attention, dense / MoE FFN, vocab."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    q_rank, kv_rank = _get(config, "q_lora_rank"), config.kv_lora_rank
    rope, nope, v = config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    moe_ffn, topk = config.moe_intermediate_size, config.num_experts_per_tok
    freq = getattr(config, "moe_layer_freq", None)                    # as Automodel: moe_layer_freq wins
    if freq is None:
        first_dense = _get(config, "first_k_dense_replace", 0)
        pattern = [i >= first_dense for i in range(layers)]
    else:
        pattern = [i % freq == 0 for i in range(layers)] if isinstance(freq, int) else [bool(f) for f in freq]
    attention = 6 * layers * (0.5 * (nope + rope) * heads * seq ** 2 + 0.5 * v * heads * seq ** 2)
    q = h * q_rank + q_rank * (nope + rope) * heads if q_rank else h * (nope + rope) * heads
    mla = q + h * rope + h * kv_rank + kv_rank * (nope + v) * heads + v * heads * h
    dense_ffn = h * config.intermediate_size * 3
    moe_ffn_params = h * moe_ffn * 3 * (1 + topk)                     # one shared + top-k routed
    ffn = sum(moe_ffn_params if is_moe else dense_ffn for is_moe in pattern)
    linear = 6 * (mla * layers + ffn) * seq
    vocab = 6 * config.vocab_size * h * seq
    return (attention + linear + vocab) * batch


def _attention_6x(seq, h, heads, groups, head_dim, window=None):
    """Automodel ``attention_flops_calculator`` (x6 for forward + backward)."""
    qkv = seq * h * head_dim * (heads + 2 * groups)
    proj = seq * h * head_dim * heads
    nonzero = window * (window + 1) / 2 + (seq - window) * window if window else seq * (seq + 1) / 2
    return 6 * (qkv + proj + heads * nonzero * head_dim * 2)


def gpt_oss(config, batch: int, seq: int) -> float:
    """Automodel ``gpt_oss_flops``: full attention on even layers, window-128 attention on odd ones,
    GLU experts x top-k, vocab."""
    h, heads = config.hidden_size, config.num_attention_heads
    groups = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "kv_channels", h // heads)                 # Automodel's head width (see above)
    window = 128                                                        # Automodel's default window
    ffn = _get(config, "moe_ffn_hidden_size", config.intermediate_size)
    topk = config.num_experts_per_tok
    total = 0.0
    for i in range(config.num_hidden_layers):
        total += _attention_6x(seq, h, heads, groups, head_dim, None if i % 2 == 0 else window)
        total += 6 * seq * topk * (h * ffn * 2 + ffn * h)
    total += 6 * seq * h * config.vocab_size
    return total * batch


FORMULAS = {"Qwen3MoeConfig": qwen3, "Qwen3Config": qwen3, "Qwen2Config": qwen3, "MixtralConfig": mixtral,
            "DeepseekV3Config": deepseek_v3, "GptOssConfig": gpt_oss}


def model_flops(config, batch: int, seq_len: int) -> float | None:
    """FLOPs of one training step on ``batch`` sequences of ``seq_len`` tokens; None for a config
    class Automodel has no formula for here."""
    formula = FORMULAS.get(type(config).__name__)
    return None if formula is None else float(formula(config, batch, seq_len))
