"""Hybrid models (Qwen3.5): their Gated DeltaNet layers on packed rows.

Most of a Qwen3.5 decoder's layers are Gated DeltaNet (transformers 5.19,
models/qwen3_5/modeling_qwen3_5.py, Qwen3_5GatedDeltaNet): a short causal convolution over the
tokens (`causal_conv1d_fn`), then a recurrence whose state carries every earlier token
(`torch_chunk_gated_delta_rule`). In a packed row (grpo.pack) neither may carry anything from
one sample into the next. The layer hands both functions the row's boundaries
(cu_seq_lens_q), but transformers' own torch versions ignore them: on a packed row, without
the causal-conv1d and flash-linear-attention packages, every sample after the first reads the
samples before it (tests/test_hybrid.py measures 0.4 on the logits of a tiny model). The
packages take the boundaries in their kernels, on GPUs only; Ascend and CPU run the torch
versions.

`patch` replaces the two functions in the model's transformers module with `conv` and
`chunk_rule` (transformers 5.5.4, the Ascend stack's, binds them in each layer and hands them no
boundaries: there each layer gets its own, and a hook hands it the boundaries; `_attach`).
On a packed row, these scatter the row into a right-padded (samples, longest, ...)
batch, run the function they replace on it, and gather the outputs back, as
fsdp_utils.packed_sdpa does for attention. Both are causal, so the right padding changes no
real position, and each sample starts from a zero state and zero convolution inputs. Their
cost is the padding's. Elsewhere (a padded batch, the engine's own model) they are the
functions they replace, unchanged. Under Ulysses (model.sp_size > 1) each rank holds part of a
row's tokens: `conv` and `chunk_rule` then exchange them (seq_parallel's all-to-alls) so that
each rank runs the whole row for its share of the channels or heads.
"""

import functools
import importlib
import importlib.util

import torch
import torch.distributed as dist

import npu_ops
from config import BadInput, need
from modeling import seq_parallel

# the oldest transformers whose Gated DeltaNet layer calls these module-level functions with the
# row's boundaries; 5.5.4 (the Ascend stack's) binds its own per layer and passes none (_attach)
TRANSFORMERS = "5.19"

# model_type -> the transformers module whose functions the Gated DeltaNet layers call
MODULES = {"qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
           "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
           "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"}
FUNCTIONS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")

# The recurrence's chunk on packed rows, in tokens. The chunked rule is exact at any chunk, and
# transformers pads each sample to whole chunks (64 tokens unless told), so a run of samples of
# at most 20 tokens pays 64 for each: train_grpo sets it to the longest a sample can be
# (rollout.max_model_len), up to 64 (measured on CPU, fp32, 64 samples of 7 tokens: forward
# and backward 169 ms a layer at 64, 43 ms at 20). One value for the run, not one a row: each
# sample's arithmetic then depends on it alone, whatever row it is packed in (and at sp 1 as
# at sp 2).
CHUNK = 64


def has_linear_attention(config) -> bool:
    """Whether a model's layers include Gated DeltaNet ones (config.layer_types): a transformers
    config, or its config.json as a dict."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text = get("text_config", None)
    if text is not None:
        return has_linear_attention(text)
    return "linear_attention" in (get("layer_types", None) or ())


def check(text: dict, sp_size: int, engine_dtype: str, shared_prefix: str = "off") -> None:
    """What a hybrid model (`text`: its config.json's language part) cannot do yet, or not in
    this engine dtype here, refused in one line before anything loads
    (fsdp_utils.ModelConfig.check_model calls it)."""
    if not has_linear_attention(text):
        return
    kind = text.get("model_type")
    problem = unsupported(kind)
    need(problem is None, f"model.path: {problem}")
    heads = text.get("linear_num_value_heads") or 0
    channels = 2 * (text.get("linear_num_key_heads") or 0) * (
        text.get("linear_key_head_dim") or 0) + heads * (text.get("linear_value_head_dim") or 0)
    need(sp_size == 1 or heads % sp_size == channels % sp_size == 0,
         f"model.sp_size={sp_size} on a hybrid model ({kind}) whose Gated DeltaNet layers "
         f"have {heads} value heads: Ulysses gives each rank whole heads of their recurrence "
         f"(and 1/sp of its convolution's {channels} channels). Fix: an sp_size that divides "
         "both")
    need(shared_prefix != "on", f"config: grpo.shared_prefix=on on a hybrid model ({kind}) does "
         "not carry a prompt's recurrent state into its responses (its linear-attention "
         "layers). Fix: grpo.shared_prefix=auto (off there), or off")
    try:
        npu_ops.check_hybrid_engine(engine_dtype)
    except ValueError as e:
        raise BadInput(f"config: {e}") from None
    # vLLM 0.32's models/qwen3_5.py imports qwen3_vl.py, which imports transformers 5.19's
    # Qwen2-VL image processor, which imports torchvision whatever the model's inputs
    need(importlib.util.find_spec("torchvision") is not None, f"model.path: a {kind} model in "
         "vLLM imports its vision processors, which need torchvision, and this environment has "
         "none. Fix: install the torchvision built for this torch")


def unsupported(kind: str) -> str | None:
    """Why this process cannot pack a hybrid model of this model_type (its state would leak
    from one sample into the next), with the fix; None where it can."""
    if kind not in MODULES:
        return (f"model_type {kind!r} has linear-attention layers that hybrid.py does not "
                "know, and packed rows would leak state from one sample into the next. Fix: "
                "add its module to hybrid.MODULES")
    return None


def _transformers() -> str:
    import transformers
    return transformers.__version__


def transformers_ok() -> bool:
    """Whether this transformers' Gated DeltaNet layers call the module's functions, with the
    row's boundaries (TRANSFORMERS and later); else `patch` attaches its own to each layer."""
    from packaging.version import Version
    return Version(_transformers()) >= Version(TRANSFORMERS)


def patch(model) -> bool:
    """Make `model`'s Gated DeltaNet layers run each sample of a packed row on its own; returns
    whether it has such layers, raises where `unsupported` says why it cannot. Call it on the
    model as built (before FSDP wraps it; the meta device is fine).
    - transformers TRANSFORMERS and later: `conv` and `chunk_rule` in place of the two functions
      in the model's transformers module (once a process; the originals kept as
      `_packed_original`), which its layers look up at each call with the row's boundaries.
    - older (5.5.4, the Ascend stack's): each layer holds its own two functions and is handed no
      boundaries (`_attach`)."""
    config = model.config
    if not has_linear_attention(config):
        return False
    problem = unsupported(config.model_type)
    if problem is not None:
        raise ValueError(problem)
    if not transformers_ok():
        _attach(model)
        return True
    module = importlib.import_module(MODULES[config.model_type])
    for name, ours in zip(FUNCTIONS, (conv, chunk_rule)):
        current = getattr(module, name)
        if getattr(current, "_packed_original", None) is None:
            wrapped = _with_original(ours, current)
            setattr(module, name, wrapped)
    return True


def _attach(model) -> None:
    """transformers before TRANSFORMERS (5.5.4, modeling_qwen3_5.py): each Gated DeltaNet layer
    binds its functions at construction (`causal_conv1d_fn`, None without the causal-conv1d
    package, then an nn.Conv1d runs; `chunk_gated_delta_rule`), and its decoder layer calls it
    without the row's boundaries, which the decoder layer itself receives. So each layer gets
    `conv` and `chunk_rule` as its own functions, and a hook on its decoder layer hands it the
    boundaries of every call (gradient checkpointing's recomputation included: it calls the
    decoder layer again)."""
    found = 0
    for block in model.modules():
        gdn = getattr(block, "linear_attn", None)
        if gdn is None or getattr(gdn, "_packed_rows", False) is not False:
            continue
        if not all(hasattr(gdn, f) for f in ("causal_conv1d_fn", "chunk_gated_delta_rule")):
            raise ValueError(f"{type(gdn).__name__} holds no causal_conv1d_fn and "
                             "chunk_gated_delta_rule of its own, which hybrid.py replaces on "
                             f"transformers < {TRANSFORMERS}. Fix: transformers >= {TRANSFORMERS}")
        gdn._packed_rows = (None, None, None)
        block.register_forward_pre_hook(_hand_rows, with_kwargs=True)
        gdn.causal_conv1d_fn = functools.partial(_layer_conv, gdn,
                                                  gdn.causal_conv1d_fn or _torch_conv)
        gdn.chunk_gated_delta_rule = functools.partial(_layer_rule, gdn,
                                                       gdn.chunk_gated_delta_rule)
        found += 1
    if not found:
        raise ValueError(f"{type(model).__name__}: no Gated DeltaNet layer (linear_attn) found "
                         f"to give the row's boundaries. Fix: transformers >= {TRANSFORMERS}")


def _hand_rows(block, args, kwargs) -> None:
    """A decoder layer's forward pre-hook: its Gated DeltaNet layer's boundaries for this call."""
    block.linear_attn._packed_rows = (kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"),
                                      kwargs.get("row"))


def _torch_conv(x, weight, bias=None, activation=None, **_):
    """What a 5.5.4 layer runs without the causal-conv1d package: its depthwise nn.Conv1d
    (padding kernel - 1, the outputs past the input's length cut), then the activation."""
    out = torch.nn.functional.conv1d(x, weight[:, None], bias, padding=weight.shape[-1] - 1,
                                     groups=x.shape[1])[..., :x.shape[-1]]
    return torch.nn.functional.silu(out) if activation in ("silu", "swish") else out


def _layer_conv(gdn, original, x, weight, bias=None, activation=None, **kwargs):
    cu, longest, row = gdn._packed_rows
    if cu is None and row is None:
        return original(x, weight, bias, activation=activation, **kwargs)
    return conv(original, x, weight, bias, activation, cu_seq_lens_q=cu, max_length_q=longest,
                row=row)


def _layer_rule(gdn, original, query, key, value, g, beta, **kwargs):
    cu, longest, row = gdn._packed_rows
    if cu is None and row is None:
        return original(query, key, value, g=g, beta=beta, **kwargs)
    return chunk_rule(original, query, key, value, g, beta, cu_seqlens=cu, max_length_q=longest,
                      row=row, **kwargs)


def _with_original(ours, original):
    def function(*args, **kwargs):
        return ours(original, *args, **kwargs)
    function._packed_original = original
    function.__name__ = ours.__name__
    return function


def rows(cu_seq_lens, longest, length: int):
    """A packed row's places: each of its `length` tokens' sample and position in it ((R,)
    device tensors), the number of samples and the longest's length; or None for no row.
    From the device's boundaries, with no read back to the host."""
    if cu_seq_lens is None or longest is None:
        return None
    n = cu_seq_lens.shape[0] - 1
    lens = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(n, device=lens.device), lens, output_size=length)
    pos = torch.arange(length, device=lens.device) - cu_seq_lens[:-1].long()[seq]
    return seq, pos, n, int(longest)


def _spread(x, where):
    """(1, R, ...) -> (n, longest, ...) zero-padded: each sample's tokens in its own row."""
    seq, pos, n, longest = where
    out = x.new_zeros(n, longest, *x.shape[2:])
    out[seq, pos] = x[0]
    return out


def conv(original, hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' causal_conv1d_fn ((B, C, T) in and out), each sample of a packed row on its
    own. Under Ulysses (kwargs' `row`: logprobs.split_row) `hidden_states` holds this rank's
    tokens of the row; the convolution is depthwise, so each rank runs it over every token of
    the row for 1/sp of the channels (its slice of the weight), one all-to-all there and one
    back (seq_parallel's, as attention's heads)."""
    if kwargs.get("row") is not None:
        row, group = kwargs["row"], kwargs["row"]["group"]
        part, rank = hidden_states.shape[1] // dist.get_world_size(group), dist.get_rank(group)
        mine = slice(rank * part, (rank + 1) * part)
        whole = seq_parallel.heads_to_sequence(hidden_states[..., None], group)[..., 0]
        out = conv(original, whole, weight[mine], None if bias is None else bias[mine],
                   activation, cu_seq_lens_q=row["cu_seq_lens_q"],
                   max_length_q=row["max_length_q"])  # (1, C / sp, N)
        back = seq_parallel.sequence_to_heads(out.transpose(1, 2)[..., None], group)
        return back[..., 0].transpose(1, 2)  # (1, C, n)
    where = rows(kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"),
                 hidden_states.shape[-1])
    if where is None:
        return original(hidden_states, weight, bias, activation=activation, **kwargs)
    seq, pos, _, _ = where
    padded = _spread(hidden_states.transpose(1, 2), where)  # (n, longest, C)
    out = original(padded.transpose(1, 2), weight, bias, activation=activation)
    return out.transpose(1, 2)[seq, pos].T[None]  # (1, C, R)


def chunk_rule(original, query, key, value, g, beta, cu_seqlens=None, **kwargs):
    """transformers' torch_chunk_gated_delta_rule ((B, T, heads, dim) in and out, g and beta
    (B, T, heads)), each sample of a packed row from a zero state. A packed row is a training
    forward: no state comes in or goes out (the final state is None). Under Ulysses (kwargs'
    `row`) the inputs are this rank's tokens, every head; the heads' recurrences are
    independent, so each rank runs 1/sp of the heads over the whole row, between the two
    all-to-alls attention uses."""
    if kwargs.get("row") is not None:
        row = kwargs.pop("row")
        group = row["group"]

        def whole(x):  # (1, n, H, ...) this rank's tokens -> (1, N, H / sp, ...) the row's
            y = x if x.dim() == 4 else x[..., None]
            y = seq_parallel.heads_to_sequence(y.transpose(1, 2), group).transpose(1, 2)
            return y if x.dim() == 4 else y[..., 0]

        out, _ = chunk_rule(original, *(whole(x) for x in (query, key, value, g, beta)),
                            cu_seqlens=row["cu_seq_lens_q"], **{
                                **kwargs, "max_length_q": row["max_length_q"]})
        return seq_parallel.sequence_to_heads(out, group), None
    where = rows(cu_seqlens, kwargs.get("max_length_q"), query.shape[1])
    if where is None:
        return original(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, **kwargs)
    if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
        raise ValueError("hybrid.chunk_rule: a packed row carries no recurrent state in or out")
    seq, pos, _, _ = where
    keep = {k: v for k, v in kwargs.items() if k in ("chunk_size", "use_qk_l2norm_in_kernel")}
    keep.setdefault("chunk_size", CHUNK)
    out, _ = original(*(_spread(x, where) for x in (query, key, value)),
                      g=_spread(g, where), beta=_spread(beta, where), **keep)
    return out[seq, pos][None], None
