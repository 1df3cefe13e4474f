"""The aten attention ops the CUDA block kernels call (and their lower-level siblings), with their schema in every
supported torch release, 2.11 through 2.15, and the layout of the log-sum-exp each returns.

Taken from each release's ``native_functions.yaml`` (``torchgen/packaged/ATen/native/`` of the torch 2.11.0, 2.12.1,
2.13.0, 2.14.1 and 2.15.0 wheels); tests/test_aten_meta.py checks the installed torch's schemas
(``torch._C._jit_get_schemas_for_operator``) against the entry for its version and calls every op the glue uses on
the meta device. The six ``_scaled_dot_product_*`` ops :mod:`automodel.distributed.cp.cuda_blocks` calls have one
schema across 2.11-2.15, so the glue has one call per op; the differences are in ops it does not call
(``_flash_attention_forward`` gained ``block_table`` / ``num_splits`` in 2.12, ``_cudnn_attention_forward``
``seqused_k`` / ``block_table`` in 2.14; all keyword-only, so positional callers are unaffected). A release that
changes a called op makes :func:`schema_problem` name it, and the glue must then branch on
:func:`torch_release`.

The log-sum-exp (:data:`LSE_LAYOUT`, from each release's ``torch/_meta_registrations.py``, the same in 2.11-2.15):
flash ``[B, H, n]`` fp32; memory-efficient ``[B, H, ceil(n / 32) * 32]`` fp32 on CUDA (``[B, H, n]`` on ROCm); cuDNN
``[B, H, n, 1]`` fp32. The glue returns ``[B, H, n]`` fp32 from each and hands each backward its own layout back.

Grouped heads (:data:`GROUPED_KV`): cuDNN's op takes K/V with fewer heads than Q (a divisor) and its backward returns
dK/dV with K/V's own head count. Its graph is built from each tensor's own sizes and strides
(``aten/src/ATen/native/cudnn/MHA.cpp``, ``build_graph`` / ``build_graph_backward``: ``set_dim(k.sizes())``; the
nested-tensor graphs carry ``h_q``, ``h_k``, ``h_v`` explicitly), the meta kernels of 2.11-2.15 allocate
``grad_key = empty_like(key)`` (``meta__scaled_dot_product_cudnn_backward``), the cuDNN maintainers state the op
never rejected unequal head counts that divide (pytorch/pytorch issue #139586, 2024-11) and SDPA's gate lets GQA
through to cuDNN with ``requires_same_num_heads=false`` since PR #150337 (2025-04), before 2.11. Flash takes them
too, in every release 2.11-2.15: FlashAttention-2's ``mha_fwd`` / ``mha_bwd``
(``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``) check only ``num_heads % num_heads_k == 0``
(the message "Number of heads in key/value must divide number of heads in query" is in each release's
``libtorch_cuda.so``), the backward returns ``dk = empty_like(k)`` at K/V's head count after summing its own
``dk_expanded`` / ``dv_expanded`` (``[B, Sk, Hq, D]`` each, allocated inside the op), SDPA's own dispatch hands flash
grouped K/V (``can_use_flash_attention``: ``backend_supports_grouped_query_attention = true``, sdp_utils.cpp), and
the meta kernels of 2.11-2.15 return grouped dK/dV (tests/test_aten_meta.py). The memory-efficient kernel keeps
K/V repeated by the glue (SDPA's efficient path takes equal heads only).

The packed-row cuDNN call (:func:`cudnn_varlen_runs`, :func:`cudnn_varlen_problem`): ``_cudnn_attention_forward(query
[T, Hq, D], key [T, Hk, D], value [T, Hk, Dv], attn_bias=None, cum_seq_q [N+1] int32, cum_seq_k, max_q, max_k,
compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale)`` returns ``(out [T, Hq, Dv], logsumexp,
cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug)``; ``_cudnn_attention_backward(grad_out,
query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
dropout_p, is_causal, *, scale)``. Its log-sum-exp (:data:`VARLEN_LSE_LAYOUT`) is ``[Hq, T]`` fp32 in 2.14-2.15:
``run_cudnn_SDP_fprop_nestedtensor`` (``aten/src/ATen/native/cudnn/MHA.cpp``) allocates ``{h_q, T}`` ("cuDNN wants
T, H, 1, but torch/FA convention is H, T"), asserts "cuDNN SDPA expected a 2D (H, T) softmax_lse" in the forward
and the backward (both messages are in the 2.14.1 and 2.15.0 ``libtorch_cuda.so``, in none of 2.11-2.13), and
torch's own ``varlen_attn`` fake returns ``(num_heads, total_q)`` for it. An older ``MHA.cpp`` allocated
``{T, h_q, 1}``; the 2.11-2.13 binaries lack the (H, T) asserts, so the table says ``[T, Hq, 1]`` there (read from
source and strings only: torch never runs the call on those releases, and neither does the glue). The op is in 2.11-2.15 with one positional signature (2.14 adds keyword-only
``seqused_k`` / ``block_table``), but torch itself runs it only from 2.14, and not for every call
(``torch.nn.attention.varlen``):

- 2.11-2.13: ``_should_use_cudnn`` returns ``False`` (and its unused cuDNN backward call passes the arguments in
  another order than the schema);
- 2.14 (``_can_use_cudnn``): a runtime cuDNN >= 9.18 on compute capability 9.x / 10.x, fp16/bf16, head sizes
  multiples of 8, ``max_q`` past 128, equal head counts, and ``window_size == (-1, -1)``: NOT causal (a causal call
  is ``window_size == (-1, 0)`` there and runs flash);
- 2.15 (``_cudnn_rejection_reasons``): the same device rule; ``max_q`` <= 128 only with cuDNN >= 9.24; causal only
  with one ``cu_seq`` tensor for Q and K (the packed call aligns the causal diagonal top-left, which is the
  FlashAttention semantics only for square documents); GQA taken; and only where SDPA's enabled backends and
  priority put cuDNN before flash (:func:`varlen_follows_sdpa`).

The glue calls it on exactly those releases and conditions (:func:`cudnn_varlen_problem` per call), hands the LSE
back to the backward as returned (Ulysses' document blocks) or, where it merges blocks (thd, thd_docs), reads it as
:data:`VARLEN_LSE_LAYOUT` says and hands the merged LSE back in the same layout; it repeats grouped K/V (exact, and
what 2.14 requires; 2.15 takes them as they are). It has no meta kernel in 2.11-2.15, so tests/test_aten_meta.py
checks its schema and runs the glue against a stand-in bound to that schema.

Flash through ``varlen_attn`` (:data:`VARLEN_GQA`): every release hands K/V as they are to
``aten._flash_attention_forward`` / ``_flash_attention_backward`` with ``cum_seq_q`` / ``cum_seq_k``, FlashAttention-2's
``mha_varlen_fwd`` / ``mha_varlen_bwd``, which check only ``num_heads % num_heads_k == 0`` and return dK/dV at K/V's
head count, as the padded ops do (:data:`GROUPED_KV`); the fake kernels return ``empty_like(key)`` for dK. From 2.12
(:data:`VARLEN_ENABLE_GQA_FIRST_RELEASE`) the public ``varlen_attn`` takes ``enable_gqa`` (keyword-only), which only
adds a Python check (``Hq % Hkv == 0``; unequal heads without it raise) and reaches the same op call; 2.11's has no
such keyword and no head check (its docstring shows equal heads), so the glue passes ``enable_gqa`` where the
signature has it and grouped K/V either way. Handed grouped K/V, 2.14's ``_can_use_cudnn`` refuses its cuDNN path
(``enable_gqa or query.size(-2) != key.size(-2)``), so the call runs flash whatever the runtime cuDNN; 2.15's
``_cudnn_rejection_reasons`` has no head-count rule, so its backend follows SDPA's enabled backends and priority as
for equal heads. Read from ``torch/nn/attention/varlen.py`` of the 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 wheels;
``scripts/gpu_check.py``'s ``kernels/sdpa_flash/varlen`` line runs the call with 8 query heads over 2 KV heads against
fp32 math on the lent GPU's torch.
"""

from __future__ import annotations

import re

__all__ = ["CALLED_OPS", "CUDNN_VARLEN_CAUSAL_FIRST_RELEASE", "CUDNN_VARLEN_GQA_FIRST_RELEASE", "CUDNN_VARLEN_FIRST_RELEASE", "CUDNN_VARLEN_MIN_CUDNN",
           "CUDNN_VARLEN_SHORT_MIN_CUDNN", "GROUPED_KV", "LSE_LAYOUT", "SCHEMAS", "SUPPORTED_RELEASES",
           "VARLEN_ENABLE_GQA_FIRST_RELEASE", "VARLEN_FOLLOWS_SDPA_FIRST_RELEASE", "VARLEN_GQA", "VARLEN_LSE_LAYOUT", "VARLEN_OPS", "cudnn_varlen_problem",
           "cudnn_varlen_runs", "installed_schema", "schema_for", "schema_problem", "takes_grouped_kv", "torch_release",
           "varlen_follows_sdpa", "varlen_lse_layout", "varlen_takes_grouped_kv"]

#: the releases the tables cover
SUPPORTED_RELEASES = ("2.11", "2.12", "2.13", "2.14", "2.15")
#: the ops cuda_blocks calls (each with its backward)
CALLED_OPS = (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
)  # fmt: skip
#: the packed-row cuDNN ops the glue calls where :func:`cudnn_varlen_runs` (positional arguments only)
VARLEN_OPS = ("_cudnn_attention_forward", "_cudnn_attention_backward")
#: kernel name (block_backend) -> the LSE its forward returns
LSE_LAYOUT = {
    "sdpa_flash": "[B, H, n] fp32",
    "sdpa_efficient": "[B, H, ceil(n / 32) * 32] fp32 (CUDA; [B, H, n] on ROCm)",
    "sdpa_cudnn": "[B, H, n, 1] fp32",
    "cudnn_varlen": "[H, T] fp32 (torch 2.14-2.15; [T, H, 1] in 2.11-2.13, which never run it): VARLEN_LSE_LAYOUT",
}
#: the packed-row cuDNN call's LSE per release span: "HT" = ``[Hq, T]``, "TH1" = ``[T, Hq, 1]`` (module docstring)
VARLEN_LSE_LAYOUT = {("2.11", "2.13"): "TH1", ("2.14", "2.15"): "HT"}
#: kernel -> (first release, last release) whose op takes K/V with fewer heads than Q and returns grouped dK/dV
GROUPED_KV = {"sdpa_cudnn": ("2.11", "2.15"), "sdpa_flash": ("2.11", "2.15")}
#: torch's varlen_attn runs the packed-row cuDNN call for causal documents from this release (2.14: full only)
CUDNN_VARLEN_CAUSAL_FIRST_RELEASE = "2.15"
#: ... and for a longest query chunk of at most 128 tokens from this release, with a runtime cuDNN >= 9.24
CUDNN_VARLEN_SHORT_MIN_CUDNN = 92400
#: ... and with fewer K/V heads than Q heads (GQA) from this release (2.14's gate wants equal heads)
CUDNN_VARLEN_GQA_FIRST_RELEASE = "2.15"
#: torch's own varlen_attn runs the packed-row cuDNN call from this release, with a runtime cuDNN >= this
CUDNN_VARLEN_FIRST_RELEASE = "2.14"
CUDNN_VARLEN_MIN_CUDNN = 91800
#: from this release varlen_attn picks cuDNN or flash by SDPA's enabled backends and priority (``sdpa_kernel``;
#: ``torch.nn.attention.varlen._select_backend``), so a flash pin or auto's order decides; 2.14 runs cuDNN whenever
#: its gate passes
VARLEN_FOLLOWS_SDPA_FIRST_RELEASE = "2.15"
#: the releases whose ``varlen_attn`` hands K/V with fewer heads than Q (a divisor) to flash's varlen op as they are,
#: dK/dV coming back at K/V's head count; the keyword ``enable_gqa`` that says so from 2.12 (module docstring)
VARLEN_GQA = ("2.11", "2.15")
VARLEN_ENABLE_GQA_FIRST_RELEASE = "2.12"

#: op -> {(first release, last release): schema}
SCHEMAS: dict[str, dict[tuple[str, str], str]] = {
    "_scaled_dot_product_flash_attention": {
        ("2.11", "2.15"): (
            "_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0.0, "
            "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (Tensor output, Tensor "
            "logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor rng_state, Tensor "
            "unused, Tensor debug_attn_mask)"
        ),
    },
    "_scaled_dot_product_flash_attention_backward": {
        ("2.11", "2.15"): (
            "_scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor "
            "value, Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
            "float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, *, float? scale=None) -> "
            "(Tensor grad_query, Tensor grad_key, Tensor grad_value)"
        ),
    },
    "_scaled_dot_product_efficient_attention": {
        ("2.11", "2.15"): (
            "_scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, "
            "bool compute_log_sumexp, float dropout_p=0.0, bool is_causal=False, *, float? scale=None) -> (Tensor "
            "output, Tensor log_sumexp, Tensor philox_seed, Tensor philox_offset)"
        ),
    },
    "_scaled_dot_product_efficient_attention_backward": {
        ("2.11", "2.15"): (
            "_scaled_dot_product_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key, Tensor "
            "value, Tensor attn_bias, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, "
            "float dropout_p, bool[4] grad_input_mask, bool is_causal=False, *, float? scale=None) -> (Tensor, "
            "Tensor, Tensor, Tensor)"
        ),
    },
    "_scaled_dot_product_cudnn_attention": {
        ("2.11", "2.15"): (
            "_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool "
            "compute_log_sumexp, float dropout_p=0.0, bool is_causal=False, bool return_debug_mask=False, *, "
            "float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt "
            "max_q, SymInt max_k, Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)"
        ),
    },
    "_scaled_dot_product_cudnn_attention_backward": {
        ("2.11", "2.15"): (
            "_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor "
            "value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor attn_bias, "
            "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, "
            "float? scale=None) -> (Tensor, Tensor, Tensor)"
        ),
    },
    "_flash_attention_forward": {
        ("2.11", "2.11"): (
            "_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? "
            "cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, "
            "float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None, Tensor? "
            "seqused_k=None, Tensor? alibi_slopes=None) -> (Tensor output, Tensor softmax_logsumexp, Tensor "
            "rng_state, Tensor unused, Tensor debug_attn_mask)"
        ),
        ("2.12", "2.15"): (
            "_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? "
            "cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, "
            "float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None, Tensor? "
            "seqused_k=None, Tensor? alibi_slopes=None, Tensor? block_table=None, int? num_splits=None) -> "
            "(Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)"
        ),
    },
    "_flash_attention_backward": {
        ("2.11", "2.15"): (
            "_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
            "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
            "bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? "
            "window_size_left=None, SymInt? window_size_right=None) -> (Tensor, Tensor, Tensor)"
        ),
    },
    "_cudnn_attention_forward": {
        ("2.11", "2.13"): (
            "_cudnn_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, Tensor? "
            "cum_seq_q, Tensor? cum_seq_k, SymInt max_q, SymInt max_k, bool compute_log_sumexp, float "
            "dropout_p=0.0, bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (Tensor "
            "output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor "
            "philox_seed, Tensor philox_offset, Tensor debug_attn_mask)"
        ),
        ("2.14", "2.15"): (
            "_cudnn_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, Tensor? "
            "cum_seq_q, Tensor? cum_seq_k, SymInt max_q, SymInt max_k, bool compute_log_sumexp, float "
            "dropout_p=0.0, bool is_causal=False, bool return_debug_mask=False, *, float? scale=None, Tensor? "
            "seqused_k=None, Tensor? block_table=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, "
            "Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor philox_seed, Tensor philox_offset, Tensor "
            "debug_attn_mask)"
        ),
    },
    "_cudnn_attention_backward": {
        ("2.11", "2.15"): (
            "_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
            "Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor attn_bias, Tensor cum_seq_q, "
            "Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, float? scale=None) "
            "-> (Tensor, Tensor, Tensor)"
        ),
    },
    "_efficient_attention_forward": {
        ("2.11", "2.15"): (
            "_efficient_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? bias, Tensor? "
            "cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, float dropout_p, int "
            "custom_mask_type, bool compute_log_sumexp=False, *, float? scale=None, Tensor? seqlen_k=None, int? "
            "window_size=None) -> (Tensor output, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, "
            "SymInt max_seqlen_batch_q, SymInt max_seqlen_batch_k)"
        ),
    },
    "_efficient_attention_backward": {
        ("2.11", "2.15"): (
            "_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key, Tensor value, Tensor? "
            "bias, Tensor out, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt "
            "max_seqlen_k, Tensor logsumexp, float dropout_p, Tensor philox_seed, Tensor philox_offset, int "
            "custom_mask_type, bool bias_requires_grad, *, float? scale=None, int? num_splits_key=None, int? "
            "window_size=None, bool shared_storage_dqdkdv=False) -> (Tensor, Tensor, Tensor, Tensor)"
        ),
    },
}


def torch_release(version: str) -> str:
    """``"2.13"`` of ``"2.13.0+cu130"``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


def _key(release: str) -> tuple[int, int]:
    a, b = release.split(".")
    return int(a), int(b)


def schema_for(op: str, release: str) -> str | None:
    """The schema of aten ``op`` in torch ``release`` (``"2.11"``), or ``None`` outside the table."""
    for (first, last), schema in SCHEMAS.get(op, {}).items():
        if _key(first) <= _key(release) <= _key(last):
            return schema
    return None


def installed_schema(op: str) -> str | None:
    """The installed torch's schema of aten ``op`` (its default overload), in ``native_functions.yaml``'s spelling."""
    import torch

    for s in torch._C._jit_get_schemas_for_operator(f"aten::{op}"):
        text = str(s).removeprefix("aten::")
        if text.startswith(op + "("):
            return re.sub(r"=(-?\d+)\.(?=[,)])", r"=\1.0", text)
    return None


def takes_grouped_kv(kernel: str, release: str) -> bool:
    """Whether ``kernel``'s op in torch ``release`` (``"2.13"``) takes fewer K/V heads than Q heads (:data:`GROUPED_KV`;
    a release outside the table: ``False``, K/V are repeated)."""
    span = GROUPED_KV.get(kernel)
    return span is not None and _key(span[0]) <= _key(release) <= _key(span[1])


def cudnn_varlen_runs(release: str, cudnn_version: int | None, capability: tuple[int, int]) -> bool:
    """Whether torch ``release`` runs the packed-row cuDNN call itself on a GPU of ``capability`` with a runtime
    ``cudnn_version`` (``torch.nn.attention.varlen._should_use_cudnn``: torch >= 2.14, cuDNN >= 9.18, 9.x / 10.x),
    inside the releases this table covers."""
    if release not in SUPPORTED_RELEASES or _key(release) < _key(CUDNN_VARLEN_FIRST_RELEASE):
        return False
    return cudnn_version is not None and cudnn_version >= CUDNN_VARLEN_MIN_CUDNN and capability[0] in (9, 10)


def cudnn_varlen_problem(release: str, cudnn_version: int | None, *, causal: bool, max_q: int | None,
                         grouped: bool = False) -> str | None:  # fmt: skip
    """Why torch ``release``'s own ``varlen_attn`` would not run the packed-row cuDNN call for a call of this kind
    (``causal`` documents, square: one ``cu_seq`` for Q and K; or full attention of query chunks against key ranges;
    ``max_q`` the longest query chunk, ``None``: unknown, assumed long; ``grouped``: fewer K/V heads than Q heads
    handed to it as they are), beyond the device rule of :func:`cudnn_varlen_runs` and the dtype / head-size rules;
    ``None``: it runs it. Pure."""
    if release not in SUPPORTED_RELEASES or _key(release) < _key(CUDNN_VARLEN_FIRST_RELEASE):
        return f"torch {release}'s varlen_attn never runs the packed-row cuDNN call (torch >= 2.14 does)"
    if grouped and _key(release) < _key(CUDNN_VARLEN_GQA_FIRST_RELEASE):
        return f"torch {release}'s varlen_attn runs the packed-row cuDNN call for equal head counts only, not GQA"
    if causal and _key(release) < _key(CUDNN_VARLEN_CAUSAL_FIRST_RELEASE):
        return f"torch {release}'s varlen_attn runs the packed-row cuDNN call for full attention only, not causal"
    if max_q is not None and max_q <= 128 and (
        _key(release) < _key(CUDNN_VARLEN_CAUSAL_FIRST_RELEASE)
        or cudnn_version is None or cudnn_version < CUDNN_VARLEN_SHORT_MIN_CUDNN
    ):
        return (f"the longest query chunk ({max_q} tokens) is not past 128 tokens (torch 2.15 with cuDNN >= 9.24 "
                "takes it)")  # fmt: skip
    return None


def varlen_lse_layout(release: str) -> str | None:
    """The packed-row cuDNN call's LSE in torch ``release`` (:data:`VARLEN_LSE_LAYOUT`: ``"HT"`` / ``"TH1"``), or
    ``None`` outside the table."""
    for (first, last), layout in VARLEN_LSE_LAYOUT.items():
        if _key(first) <= _key(release) <= _key(last):
            return layout
    return None


def varlen_follows_sdpa(release: str) -> bool:
    """Whether torch ``release``'s ``varlen_attn`` chooses between cuDNN and flash by SDPA's enabled backends and
    priority (:data:`VARLEN_FOLLOWS_SDPA_FIRST_RELEASE`), inside the releases this table covers."""
    return release in SUPPORTED_RELEASES and _key(release) >= _key(VARLEN_FOLLOWS_SDPA_FIRST_RELEASE)


def varlen_takes_grouped_kv(release: str) -> bool:
    """Whether torch ``release``'s ``varlen_attn`` takes grouped K/V as they are (:data:`VARLEN_GQA`; with
    ``enable_gqa=True`` from :data:`VARLEN_ENABLE_GQA_FIRST_RELEASE`); ``False`` outside the table (repeated)."""
    return _key(VARLEN_GQA[0]) <= _key(release) <= _key(VARLEN_GQA[1]) and release in SUPPORTED_RELEASES


def schema_problem(op: str, version: str) -> str | None:
    """Why the installed torch's ``op`` differs from the table for its ``version`` (``None``: it matches, or the
    release is outside the table)."""
    want = schema_for(op, torch_release(version))
    if want is None:
        return None
    got = installed_schema(op)
    if got != want:
        return f"aten::{op} in torch {version} is {got!r}, the table (aten_schemas.SCHEMAS) has {want!r}"
    return None
