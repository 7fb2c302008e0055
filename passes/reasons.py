"""Every reason the backend gives for not rewriting an MoE region: a stable code, the message and the fix.

Codes are stable (tests, docs and users' scripts may match on them); the wording is owned here and
nowhere else. ``message(code, detail)`` fills a template from a finding's detail; a ``{at}`` field is
the node's file:line in the user's code. Add a reason by adding one entry.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    message: str   # str.format template over the finding's detail
    fix: str


_FIX_UNSUPPORTED = ("keep the code between gathering an expert's rows and combining them to linears and "
                    "element-wise ops (activations, chunk/slices of the last dim, casts); move other work out "
                    "of the expert loop")
_FIX_WEIGHTS = ("multiply the routing weight once, into the expert output after the expert's last op "
                "(out += w[tok, slot, None] * expert(x[tok])) or into the sorted input rows before its first op "
                "(expert(x[tok] * w[tok, slot, None]), torchtitan's score_before_experts)")

REASONS: dict[str, Reason] = {
    # ---- the combine (how expert outputs are written back)
    "overwrite_topk": Reason(
        "`out[idx] = expert(...)` overwrites instead of adding (top-k > 1) at {at}: the second expert of a token "
        "replaces the first", "accumulate: `out[idx] += ...`, `out.index_add_(0, idx, ...)`"),
    "unsupported_write": Reason(
        "unsupported {op} at {at}", "write expert outputs with `out.index_add_(0, tok, y)` (dim 0, alpha 1) "
        "or `out[tok] += y`, with tok and y from the same torch.where"),
    "accumulator_dtype": Reason(
        "`{op}` at {at} adds {src} expert outputs into a {dtype} tensor; eager raises there (the dtypes must "
        "match), and the rewrite would cast them and return a result, so the layer is left as written "
        "(without Inductor it raises as eager does; Inductor's own kernel for it casts)",
        "cast what is added to the output's dtype (`(y * w).to(out.dtype)`), or make the output that dtype"),
    "expert_added_twice": Reason("expert {expert} is added twice into `{acc}`", "add each expert once"),
    "partial_read": Reason(
        "the output is read half-accumulated by `{reader}` at {at}", "read the output only after the expert loop"),
    "view_before_sum": Reason(
        "`{reader}` at {at} is a view of the accumulator taken before the expert loop: what reads it sees the "
        "finished sum, which the rewrite gives as a new tensor",
        "take the view after the expert loop (or read the accumulator itself)"),
    "rows_of_next_layer": Reason(
        "another MoE layer gathers its experts' rows straight from this layer's accumulator (`{reader}` at {at}) "
        "before every expert of this layer has added to it (the two expert loops interleave); the rewrite computes "
        "the finished sum only, which that gather would not read",
        "finish this layer's expert loop before the next layer reads its accumulator, or give the next layer a "
        "tensor of its own (e.g. `out = out.clone()` after this layer's expert loop)"),
    "acc_is_input": Reason(
        "the accumulator is a graph input (mutating it in place is a side effect the rewrite would drop)",
        "accumulate into a fresh tensor (torch.zeros_like(x)) and return it"),
    "not_combined": Reason(
        "the expert rows are never combined back per token (no sum over top-k, index_add_ or scatter_add_)",
        "combine with `.view(T, K, H).sum(1)` after unsorting, or `zeros(T, H).index_add_(0, perm // K, rows)`"),
    # ---- the experts covered by a loop
    "expert_set": Reason(
        "the loop covers experts {experts}, not 0..{last} of one router",
        "loop over range(num_experts); an expert without tokens is fine (the rewrite handles empty groups)"),
    "two_routers": Reason("the experts are selected by different routers", "select every expert from one top-k"),
    "two_inputs": Reason("the experts read different input tensors", "gather every expert's rows from one input"),
    "mixed_weights": Reason("the experts use different routing-weight tensors (or only some are weighted)",
                            _FIX_WEIGHTS),
    "experts_differ": Reason("expert {expert}'s MLP differs in structure from expert 0's",
                             "give every expert the same layers; differing experts cannot be one grouped GEMM"),
    "no_expert_function": Reason("expert {expert} applies no function to its rows",
                                 "a layer with a zero-compute (identity) expert (MoE++-style) stays compiled as "
                                 "written: the rewrite needs a function per expert; if no expert computes anything "
                                 "this is a top-k gather, not an MoE layer"),
    "escaping_intermediate": Reason(
        "the expert intermediate `{node}` is also used outside the MoE region (by `{user}`)",
        "use only the combined output outside the expert loop"),
    "pairs_rounded": Reason(
        "the expert outputs are rounded from {wide} to {dtype} one (token, slot) pair at a time at {at}, before the "
        "sum over the top-k: the rewrite sums in {wide} and rounds once, which is not eager's value",
        "round after the sum over the top-k (cast the combined output), or cast to a dtype that holds the "
        "layer's input"),
    "unsupported_row_op": Reason("unsupported op `{op}` on the expert rows at {at}{why}", _FIX_UNSUPPORTED),
    "expert_checkpointed": Reason(
        "each expert is called through activation checkpointing inside the expert loop (`{op}` at {at}): the "
        "backend does not rewrite an expert function inside a checkpointed call, so the layer is compiled as "
        "written",
        "checkpoint the whole MoE layer or decoder block instead (checkpoint(moe_layer, x), or "
        "gradient_checkpointing_enable()), which is rewritten"),
    "random_in_experts": Reason(
        "the expert function draws random numbers (`{node}` at {at}, e.g. dropout in training): eager draws them "
        "per expert call, the rewrite once over the rows grouped by expert, which gives other numbers than "
        "eager's; this compile otherwise reproduces eager's draws (moe.inductor=False, or Inductor's "
        "fallback_random=True), so the layer is compiled as written",
        "nothing to fix for correctness; under Inductor's own random numbers (fallback_random=False, the default) "
        "the rewrite is made, its masks drawn by Inductor as stock torch.compile's are; or apply the dropout "
        "outside the experts (on the combined output)"),
    "written_in_place": Reason(
        "`{node}` at {at} writes in place to `{target}`, which the MoE region reads or computes, while the region "
        "runs: the rewrite reads its inputs once, where the region ends, and computes its own routing, so it "
        "would not see the write as eager does",
        "compute a new tensor instead of writing in place (`w = w * 2`, not `w.mul_(2)`), or make the write before "
        "the region starts"),
    # ---- the expert function
    "expert_operand_not_linear": Reason(
        "expert-specific operand `{node}` in a non-linear op `{op}` (only linear weights and biases may differ per "
        "expert)", "keep per-expert tensors to the weights and biases of linear layers"),
    "expert_numbers_dynamic": Reason(
        "each expert's Python number in `{op}` is a graph input of its own under dynamic=True (`{source}`, ...: "
        "Dynamo does not specialize floats there), so the experts' values may differ and one grouped op cannot "
        "apply them", "compile without dynamic=True (the default keeps such numbers constant), or set "
        "torch._dynamo.config.specialize_float = True, or make the number one shared value outside the experts"),
    "expert_numbers_differ": Reason(
        "expert {expert}'s MLP is expert 0's with another number in `{op}` ({theirs} where expert 0 has {ours}): "
        "one grouped op applies one function to every expert's rows",
        "use one number for every expert; a per-expert scale of the output can be folded into the last linear's "
        "weight (w2.weight * scale); other per-expert numbers (clamp bounds, ...) keep the layer compiled as written"),
    "weight_shapes_differ": Reason("the experts' weights of one linear have different shapes ({shapes})",
                                   "give every expert the same layer sizes"),
    "no_linear": Reason("the expert function has no linear layer", "nothing to group: not an MoE expert MLP"),
    "mixed_dtypes": Reason(
        "`{node}` at {at} multiplies {dtypes} operands outside torch.autocast; eager raises there (\"mat1 and mat2 "
        "must have the same dtype\"), and the rewrite would cast them and return a result, so the layer is "
        "compiled as written and raises as eager does",
        "give the expert input and the expert weights one dtype (model.to(dtype), or cast the input), or run the "
        "layer under torch.autocast"),
    "float64": Reason(
        "the experts compute in float64 ({what}); the fused ops accumulate in float32 (~1e-7 relative), below "
        "float64's precision", "nothing to fix: compiled as written, in float64 (the fused path runs float32, "
        "float16 and bfloat16)"),
    "weight_subclass": Reason(
        "the expert operand `{node}` is a `{cls}` (a tensor subclass with a storage format of its own: a "
        "quantized or float8 weight such as torchao's), which the fused grouped GEMMs do not take",
        "nothing to fix for a frozen quantized base (QLoRA-style fine-tuning): the layer is compiled as written, "
        "with eager's values; for the rewrite, keep the expert weights as plain bf16 / fp32 tensors"),
    "input_not_2d": Reason("expert input must be [tokens, hidden], got {shape}",
                           "flatten the tokens first: x = x.reshape(-1, hidden)"),
    "weight_not_3d": Reason("expert weight `{node}` is not 3-D", "stack expert weights as [E, in, out]"),
    "expert_count_mismatch": Reason("expert weight `{node}` has {weights} experts, the router {router}",
                                    "use one weight row per expert of the router"),
    "bias_not_per_expert": Reason("per-expert bias `{node}` is not [E, out]", "store per-expert biases as [E, out]"),
    "clamped_counts": Reason(
        "the expert counts are taken from ids clamped to E - 1 = {e} - 1 (`{node}`) while the router picks ids "
        "below {bound}: in eager the rows of ids >= E run through expert E - 1, where the rewrite drops them",
        "count the unclamped ids (histc over the router's ids) and mask the rows of ids >= E, as transformers' "
        "expert-parallel experts do, or give the router E outputs"),
    "bias_after_weights": Reason(
        "per-expert bias add `{node}` after the routing weights (y * w + b[ids]): the rewrite adds a bias before "
        "the weights", "add the bias before multiplying by the routing weights, or outside the MoE layer"),
    "bias_not_after_linear": Reason("per-expert bias add `{node}` that is not right after a linear",
                                    "add the bias right after the grouped GEMM"),
    "gmm_bias_out_dtype": Reason("`{node}`: grouped_mm with bias/out_dtype is not supported",
                                 "add the bias after the grouped GEMM and cast its output"),
    "bmm_not_gathered": Reason("`{node}`: bmm not on gathered per-pair weights W[ids]",
                               "use W[flat_ids] with bmm, or torch._grouped_mm over stacked weights"),
    # ---- routing
    "weights_before_last_op": Reason("routing weights are applied before the expert's last op{node_at}",
                                     _FIX_WEIGHTS),
    "weights_twice": Reason("the rows are multiplied by routing weights twice", _FIX_WEIGHTS),
    "weights_not_transparent": Reason(
        "the routing weights reach the expert output through `{op}` ({node}), which is not a view, routing "
        "gather or cast: the rewrite could not give it the same gradient",
        "multiply the router's weights into the expert output directly"),
    "foreign_offsets": Reason("`{node}` uses group offsets not computed from this router's ids",
                              "compute offsets as cumsum(histc(sorted_ids, E, 0, E - 1)) of the sorted ids"),
    "router_unknown": Reason("could not find the router's ids, top_k or expert count",
                             "select experts with torch.topk (or argmax) on the router's scores"),
    "token_count_mismatch": Reason("{tokens} tokens x top_k {k} != {ids} routed ids",
                                   "route every token to exactly top_k experts"),
    "topk_mismatch": Reason("{what} but the router has top_k {k}", "gather rows with perm // top_k"),
    "sort_key": Reason("the rows are sorted by `{node}`, {how}, not by the router's ids flattened token-major",
                       "sort `ids.reshape(-1)` (row r is token r // top_k, slot r % top_k) and gather rows with "
                       "perm // top_k"),
    "ids_from_graph_input": Reason(
        "the expert ids (`{node}`) are an input of this graph: the router that picked them ran in another graph "
        "(a graph break between the router and the experts), so nothing here shows they are expert numbers >= 0",
        "keep the router and the experts in one graph: moe_compile.explain lists the graph break between them (a "
        "parametrization on the expert weights, such as peft's LoRA on target_parameters, breaks there: merge the "
        "adapter, e.g. merge_and_unload(), for a compiled run)"),
    "ids_may_be_negative": Reason(
        "the expert ids (`{node}`) are not provably >= 0 (not a topk / argmax index on the way, or a write or "
        "op that can put another value in, e.g. -1 for dropped slots): eager sorts a negative id first and "
        "shifts every expert's rows (W[-1] is the last expert), where the rewrite drops it",
        "mark dropped slots with an id >= num_experts (they sort last and fall in no expert, in eager as in "
        "the rewrite), or route with the top-k indices as they are"),
    "sentinel_mismatch": Reason("sentinel mask ids >= {sentinel} but the experts number {experts}",
                                "mask ids >= num_experts"),
    "two_regions_mixed": Reason("`{node}` mixes the rows of two MoE regions", "keep each MoE layer's rows apart"),
    "batched_two_ids": Reason("the batched experts gather weights by different ids",
                              "gather every projection's weights with the same flat ids"),
    # ---- dense (every token through every expert)
    "routing_matrix_shapes": Reason("the routing matrix is scattered from ids/weights of different shapes",
                                    "scatter [T, K] weights at [T, K] ids: zeros(T, E).scatter(1, ids, w)"),
    "ids_may_repeat": Reason(
        "the routing matrix is scattered from ids `{node}` that may repeat an expert within a row (not from "
        "topk/argmax): scatter keeps one of the repeated weights, a routed rewrite would add them all",
        "take the ids from torch.topk to have this rewritten"),
    "routing_matrix_layout": Reason("the routing matrix is not multiplied as [E, T, 1]",
                                    "weight the [E, T, H] expert outputs by routing.t().unsqueeze(-1)"),
    "soft_moe": Reason(
        "the dense expert outputs are combined by `{node}`, which is not a sparse top-k routing matrix "
        "(zeros(T, E).scatter(1, ids, w)); every expert contributes to every token (soft MoE), so routed compute "
        "would change it", "nothing to fix: a soft MoE runs every expert on every token and is compiled as written"),
    "routing_matrix_form": Reason(
        "the dense expert outputs are combined by `{node}`, built from the top-k ids but not as the sparse routing "
        "matrix zeros(T, E).scatter(1, ids, w) (here: a scatter_add, a reduce, another base, a renormalisation or a "
        "write after the scatter, or a mask of the scores against their top-k), so which experts reach a token "
        "cannot be read from it",
        "if each token uses only its top-k experts, build it as `torch.zeros(T, E).scatter(1, ids, w)` with w final "
        "(renormalise w before the scatter) to have the layer run on its routed tokens only; otherwise nothing to "
        "fix: it is compiled as written"),
    "dense_not_sum": Reason(
        "the dense expert outputs are reduced over the experts by `{node}` ({op}), not summed: the rewrite computes "
        "the routed sum", "sum the weighted expert outputs over the expert dim: (y * routing).sum(0)"),
    "dense_unrouted": Reason(
        "the dense experts are summed without a routing matrix: every token uses every expert (not a sparse MoE)",
        "nothing to fix: compiled as written"),
    # ---- expert parallelism (moe_compile.parallelize_experts)
    "ep_mixed": Reason(
        "the region's expert weights are partly sharded over an expert-parallel mesh ({sharded}) and partly not "
        "({local})", "parallelize_experts shards the Parameters of the expert container (the module whose 3-D "
        "Parameters are [E, ...]): keep every per-expert tensor of the layer there, as [E, ...] Parameters, and "
        "call it on a freshly built model, and read every expert's weights the same way (not some of them under "
        "torch.no_grad()); a tensor every expert shares (e.g. one LoRA adapter for all experts) cannot be read "
        "inside an expert-parallel layer yet"),
    "ep_inconsistent": Reason(
        "the region's sharded expert weights disagree on the process group or the expert count ({groups})",
        "shard one MoE layer's experts over one mesh with one parallelize_experts call"),
    "ep_replicated_tokens": Reason(
        "tensor parallelism gives the expert-parallel ranks {shared} the same tokens (a DTensor {placement}, at "
        "{at}): expert parallelism over {ep} would send each token to its experts once per such rank, and the "
        "expert gradients would count it {times} times (the router's and dense gradients once)",
        "split the MoE layer's tokens over those ranks (sequence parallel: the layer's input a Shard(1) DTensor made "
        "local, e.g. PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), "
        "use_local_output=True) on the MoE module, its output turned back with PrepareModuleOutput, SequenceParallel "
        "norms), or put ep on a mesh dimension orthogonal to tp (init_device_mesh(device, (ep, tp), "
        "mesh_dim_names=(\"ep\", \"tp\")))"),
    "ep_tokens_unproven": Reason(
        "tensor parallelism runs over the expert-parallel ranks {ep} ({param}), and this graph does not show whether "
        "the MoE layer's tokens are split over those ranks (the tensor-parallel layers are in another graph: a "
        "graph break, a compiled submodule, an activation-checkpointed MoE layer); if those ranks hold the same "
        "tokens, the expert gradients would count each token once per rank",
        "compile the tensor-parallel layers and the MoE layer in one graph (the whole model, or compile_blocks over "
        "blocks that hold both; no graph break between them, the checkpoint around the whole block), where "
        "sequence-parallel tokens (a Shard(1) DTensor made local) are seen and rewritten; or put ep on a mesh "
        "dimension orthogonal to tp"),
    "ep_expert_count": Reason("the sharded expert weights hold {weights} experts, the router {router}",
                              "shard the expert parameters of the router's own experts"),
    # ---- forms added for issue 12
    "overwrite_then_add": Reason(
        "`{acc}` is both overwritten (`out[idx] = expert(...)`) and added to at {at}: which expert's rows survive "
        "depends on the order", "write every expert's rows the same way: `out[idx] = ...` (top-1) or `out[idx] += ...`"),
    "dense_input_nonzero": Reason(
        "the dense experts' input is scaled by the routing weights, and `{node}` ({op}) at {at} can make an "
        "unselected pair's zero row nonzero (a bias, a constant, an activation with f(0) != 0): leaving those "
        "pairs out would change the output", "multiply the routing weights into the expert output instead, or use "
        "experts without biases and with activations that map 0 to 0 (silu, gelu, relu)"),
    "retrieval_experts": Reason(
        "the experts are rows `{node}` of an embedding table gathered per token by routed ids (product-key / "
        "retrieval experts such as Doge's CDMoE): each expert is one vector, and the layer already runs as one "
        "gathered batched product with static shapes and no host sync; there is nothing to group",
        "nothing to fix: compiled as written (Inductor fuses the gathers and the products)"),
    # ---- the backend itself
    "matcher_error": Reason("{finder}: matcher error {error}",
                            "a bug in moe_compile: please report it with moe_compile.explain's output"),
    "invalid_setup": Reason("the layer cannot run as set up: {error}",
                            "the fix the error names; nothing was compiled"),
    "lowering_error": Reason("lower_region failed: {error}",
                             "a bug in moe_compile: please report it with moe_compile.explain's output"),
    # ---- never silent (passes/unclaimed.py): MoE-like code that no region covers, graph breaks in MoE code
    "compile_error": Reason(
        "compiling the rewritten graph failed ({error}); the graph was compiled unrewritten",
        "a bug in moe_compile: please report it with moe_compile.explain's output (options={\"moe.strict\": True} "
        "raises the error instead)"),
    "capture_compile_error": Reason(
        "torch could not compile this graph with the data-dependent sizes backend=\"moe\" captures (where/nonzero/"
        "boolean masks in every frame it compiles, moe.capture_dynamic) outside any region it rewrote{scope} ({error})",
        "options={\"moe.capture_dynamic\": False} compiles the frame as stock torch.compile does (graph breaks at "
        "those ops, reported as break_dynamic_shape); or write the layer in a form that is rewritten "
        "(docs/architecture.md, \"Forms\")"),
    "moe_unmatched": Reason(
        "looks like an MoE layer ({router} over {e} experts at {router_at} feeds {evidence}) but matches no "
        "form the backend rewrites{disabled}; it is compiled as written",
        "write the layer in a supported form (docs/architecture.md, \"Forms\"), e.g. `for e in range(E): tok, slot = "
        "torch.where(ids == e); out.index_add_(0, tok, w[tok, slot, None] * experts[e](x[tok]))`, or 3-D expert "
        "weights with sort + torch._grouped_mm as transformers' grouped_mm experts do; a layer that drops tokens "
        "over an expert capacity (Switch / GShard / DeepSpeed capacity factors, one-hot dispatch tensors) or lets "
        "experts choose tokens (expert-choice routing) stays unrewritten: written without it, it would compute "
        "something else; if the layer is already written so, please report it with moe_compile.explain's output"),
    "second_expert_set": Reason(
        "{router} over {e} experts at {router_at} routes an MoE region and also a second expert set (`{node}` at "
        "{at}) on the same routing; a region takes one expert set, so this one is compiled as written",
        "give each expert set a router of its own (its own top-k), or keep the experts "
        "of both sets in one [E, ...] weight (or ModuleList) so that one layer computes them"),
    "router_draws": Reason(
        "looks like an MoE layer ({router} over {e} experts at {router_at} feeds {evidence}), but its expert ids "
        "are drawn, not picked by a top-k/argmax over router scores, which is what the rewrite routes from{disabled}; "
        "it is compiled as written",
        "nothing to fix for correctness: the layer runs as stock torch.compile runs it; a router that picks its "
        "experts with torch.topk gets the grouped rewrite"),
    "ids_cast_narrow": Reason(
        "looks like an MoE layer ({router} over {e} experts at {router_at} feeds {evidence}) but its expert ids are "
        "cast to {dtype} (at {node}), which does not hold every id up to {last} (they wrap or round), and the layer "
        "reads the cast ids; the rewrite would route by the router's own ids, so it is compiled as written",
        "cast the ids with .long() or .int() (or to a dtype that holds every id below the number of experts)"),
    "ids_outside": Reason(
        "looks like an MoE layer ({router} over {e} experts at {router_at} feeds {evidence}) but the router that "
        "picked the ids is not in this graph, so the layer matches no form the backend rewrites; it is compiled as "
        "written",
        "compute the router (its torch.topk) in the same function as the expert loop: inside the function given to "
        "torch.utils.checkpoint, or checkpoint the whole MoE block; or remove the graph break between the router and "
        "the experts (TORCH_LOGS=\"graph_breaks\" names it; a forward hook on the router can cause one)"),
    "break_func_transform": Reason(
        "{what} at {at}: the compiled model is called under a torch.func transform (grad, vjp, jvp, vmap) from "
        "eager code, which Dynamo does not trace{effect}",
        "take gradients with loss.backward() or torch.autograd.grad(loss, params) on the compiled model, which "
        "the rewrite serves; a torch.func transform inside the compiled function traces, but runs the MoE layer "
        "unrewritten (func_transform)"),
    "break_module_backward_hook": Reason(
        "{what} at {at}: a module called there has a backward hook (register_full_backward_hook or "
        "register_full_backward_pre_hook), which Dynamo does not trace{effect}",
        "register the hook on a module outside the MoE layer (the decoder layer, or the model), or use a tensor "
        "hook (`out.register_hook(...)` in forward, or on a Parameter), which the rewrite keeps"),
    "func_transform": Reason(
        "the MoE layer at {at} runs under a torch.func transform traced into the compiled graph (`{transform}`); "
        "the backend does not rewrite inside one, so the layer is compiled as written",
        "take gradients with loss.backward() or torch.autograd.grad(loss, params) on the compiled model, which "
        "the rewrite serves (functional_call works inside or outside the compile); torch.func.grad / vjp / jvp / "
        "vmap run this layer unrewritten"),
    "nested_region": Reason(
        "a top-{k} router over {e} experts runs inside `{subgraph}`, a torch.compiler.nested_compile_region "
        "subgraph called at {at}; the backend does not rewrite inside such subgraphs, so it is compiled as written",
        "compile each block on its own instead: drop nested_compile_region and call "
        "moe_compile.compile_blocks(model) (one compiled graph serves every block of a class)"),
    "ran_eagerly": Reason(
        "`{module}` ({cls}: {what}) ran eagerly under torch.compile: Dynamo never handed it to the backend, so "
        "it was not rewritten (no graph break in MoE code says why)",
        "find what made Dynamo run it eagerly (TORCH_LOGS=\"graph_breaks\"): a graph break anywhere inside "
        "activation checkpointing (torch.utils.checkpoint, gradient_checkpointing_enable) runs the whole "
        "checkpointed call eagerly, and a frame Dynamo gives up on runs as written; remove that graph break, or "
        "compile each decoder layer on its own with moe_compile.compile_blocks(model) (a break inside a layer "
        "then splits its graph instead); code under torch.compiler.disable always runs eagerly, and so do the "
        "segments of torch.utils.checkpoint.checkpoint_sequential, which Dynamo skips (call checkpoint() per "
        "segment instead)"),
    "router_logits_recorder": Reason(
        "`{module}` ({cls}: {what}) was not rewritten: transformers records per-layer outputs (the router logits of "
        "output_router_logits=True, for the load-balancing loss) with forward hooks on {hooks}, installed all at once "
        "by the first call that asked for any output_* (router logits, hidden states, attentions), which read a "
        "ContextVar and append to a list outside the layer; {how}",
        "compile the whole model, torch.compile(model, backend=\"moe\"): its forward sets the recorder inside the "
        "trace, and the layers are rewritten with the recorder in their graph; with activation checkpointing also "
        "set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True (Dynamo then keeps the "
        "append in the checkpointed forward and skips it in the backward's recomputation, where eager's recorder "
        "appends nothing either: no collector is set then; the flag applies to all checkpointed code, so other "
        "Python side effects in it are not replayed in the backward as eager replays them); or train without "
        "output_router_logits (under compile_blocks the hooks break each block once any call "
        "has asked for an output_*, whatever later calls ask: reload the model and do not ask)"),
    "break_expert_hit_hf": Reason(
        "{what} at {at}: transformers' eager experts loop `{source}` iterates over a data-dependent list of the "
        "experts that got tokens{effect}",
        "load the model with experts_implementation=\"grouped_mm\" (or call "
        "model.set_experts_implementation(\"grouped_mm\")): {cls} supports it, and backend=\"moe\" rewrites it"),
    "break_expert_hit": Reason(
        "{what} at {at}: `{source}` loops over a data-dependent list of the experts that got tokens{effect}",
        "{cls} has no experts_implementation switch (transformers' @use_experts_implementation is not applied to "
        "it): loop over every expert instead, `for expert_idx in range(num_experts):` (an expert without tokens is "
        "fine: the rewrite handles empty groups), e.g. in a subclass whose forward replaces the loop (a router "
        "that drops tokens over an expert capacity, as Switch Transformers', stays unrewritten even then)"),
    "break_split_sizes": Reason(
        "{what} at {at}: `{source}` needs the group sizes on the host (a sync and a data-dependent Python "
        "list){effect}",
        "keep the sizes on the device: offsets = cumsum(counts, 0, dtype=torch.int32) and one "
        "torch._grouped_mm(x_sorted, W, offs=offsets) over stacked expert weights W [E, ...] (backend=\"moe\" "
        "rewrites that form), or loop over range(num_experts) with torch.where(ids == e)"),
    "break_tolist": Reason(
        "{what} at {at}: `{source}` moves routing counts to the host (a sync, and a data-dependent Python "
        "list){effect}",
        "keep the counts on the device: loop over range(num_experts) unconditionally with torch.where(ids == e) "
        "(an expert with no tokens is fine), or sort by expert and call torch._grouped_mm with offsets = "
        "cumsum(counts) (any .tolist() of counts breaks the graph, fixed-length counts included)"),
    "break_item": Reason("{what} at {at}: `{source}` syncs with the host (`.item()`){effect}",
                         "if the value only decides whether to skip an expert without tokens, remove it and that "
                         "check (the rewritten experts handle empty groups); else keep the value a tensor and use it "
                         "in tensor ops (a Python `if` on it is a graph break too)"),
    "break_data_dependent": Reason(
        "{what} at {at}: `{source}` branches on tensor data (e.g. skipping experts without tokens){effect}",
        "remove the branch: the rewritten experts handle empty groups"),
    "break_random_branch": Reason(
        "{what} at {at}: `{source}` branches on a random draw (module or layer dropout: skip a module when "
        "`torch.rand(1) < p`){effect}",
        "for a compiled run set that dropout probability to 0 (peft: module_dropout / rank_dropout of LoHa, LoKr), or "
        "draw the decision outside the compiled code (Python's random, or torch.rand(...).item() before the call) "
        "and pass it in as a Python bool"),
    "break_parametrization": Reason(
        "{what} at {at}: `{source}`: computing a parametrized weight (torch.nn.utils.parametrize: peft's LoRA through "
        "target_parameters, weight or spectral norm) runs code Dynamo cannot trace{effect}",
        "for a compiled run fold the parametrization into the weight (peft: merge_and_unload(); torch: "
        "torch.nn.utils.parametrize.remove_parametrizations(module, name)), or put adapters on nn.Linear experts "
        "(peft's target_modules)"),
    "break_in_expert_loop": Reason(
        "{what} at {at}: `{source}`: a graph break inside the loop's body, where Dynamo cannot resume (it gives "
        "up on the loop); {cause}{effect}",
        "move calls Dynamo cannot trace (retain_grad, print, .tolist()) out of the loop; select each expert's rows "
        "with tensor ops (`tok, slot = torch.where(ids == e)`), or sort the rows and run torch._grouped_mm with "
        "offsets from the counts (no host reads); TORCH_LOGS=\"graph_breaks\" names the break in the body"),
    "break_bincount": Reason(
        "{what} at {at}: `{source}`: bincount has a data-dependent output length{effect}",
        "use `one_hot(ids, E).sum(0)` or `torch.histc(ids.float(), bins=E, min=0, max=E - 1)`"),
    "break_dynamic_shape": Reason(
        "{what} at {at}: `{source}` has a data-dependent output shape and data-dependent capture is off{effect}",
        "leave options[\"moe.capture_dynamic\"] at True (the default): backend=\"moe\" then captures "
        "where/nonzero/boolean masks (unless it was turned off after a capture_compile_error: then this frame "
        "runs as stock torch.compile runs it)"),
    "recompile_limit": Reason(
        "{what} at {at}: Dynamo hit torch._dynamo.config.{limit} ({value}) for this frame{effect}; every call whose "
        "guards no compiled graph passes (a new input shape, dtype or attribute value) runs eagerly from now on, "
        "MoE layer included (not rewritten)",
        "let the varying size be symbolic instead of recompiling per value: torch.compile(..., dynamic=True) or "
        "torch._dynamo.mark_dynamic(x, dim) on the inputs (TORCH_LOGS=\"recompiles\" names the guard that failed); "
        "where the sizes include 0 or 1 (which Dynamo specialises even when dynamic), "
        "torch._dynamo.decorators.mark_unbacked(x, dim); "
        "compile each block with moe_compile.compile_blocks(model) (one graph serves every block of a class); "
        "or raise torch._dynamo.config.{limit}"),
    "recompile_limit_per_layer": Reason(
        "{what} at {at}: Dynamo hit torch._dynamo.config.{limit} ({value}) for this frame{effect}, on a guard that "
        "reads per-layer state (`{guard}`): every decoder layer of a class runs this one frame (a per-block compile, "
        "moe_compile.compile_blocks), and a KV cache indexed by the layer (generate() with a DynamicCache) makes "
        "each layer compile graphs of its own; past the limit every call of this frame that no compiled graph serves "
        "runs eagerly, MoE layer included (not rewritten): decoding steps, and training batches of a new shape "
        "after them",
        "for generation compile the whole model in place, model.compile(backend=\"moe\") (generate() then "
        "runs its compiled forward, whose graphs hold every layer: a few at any depth; generate() of the "
        "module torch.compile(model) returns runs the uncompiled forward); or raise "
        "torch._dynamo.config.{limit} to about 3 x the number of layers"),
    "break_ddp_buckets": Reason(
        "{what} after {at}: `{source}`: Dynamo's DDPOptimizer splits the graph of a DistributedDataParallel model "
        "at DDP's gradient buckets, here inside an MoE layer{effect}",
        "torch._dynamo.config.optimize_ddp = False before the first call: one graph per frame, the MoE layers whole "
        "(DDP then reduces the gradients after the compiled backward, not overlapped with it); or FSDP2 (fully_shard "
        "per block), which splits no graph"),
    "break_other": Reason(
        "{what} at {at}: `{source}`: {reason}{effect}",
        "move the code Dynamo cannot trace out of the MoE layer, or write it with tensor ops; TORCH_LOGS="
        "\"graph_breaks\" prints Dynamo's full explanation"),
}


def message(code: str, detail: dict) -> str:
    """The filled message of ``code`` (missing fields read "?")."""
    template = REASONS[code].message

    class _Missing(dict):
        def __missing__(self, key):
            return "?"

    return template.format_map(_Missing(detail))


def fix(code: str) -> str:
    return REASONS[code].fix
