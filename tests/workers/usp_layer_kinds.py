"""usp (cp=4 = ulysses 2 x ring 2) on every attention layer kind, against one process (tests/test_usp.py).

Run inside tests/workers/usp_worker.py's 4-rank launch. Tiny models of tests/family_matrix.py, each in fp32
and fp64, on two packed rows of documents run alone in one process (the reference): sliding windows
(Mistral), sinks with windows and eager attention (gpt-oss), softcapping with windows and eager attention
(Gemma 2), MLA value heads (DeepSeek-V3), chunked attention and NoPE layers with Llama 4's query temperature
(switched on, with a ``floor_scale`` small enough that the temperature changes along a document), DeepSeek
sparse attention (DeepSeek-V3.2, GLM-5; every MLP dense, top-k 16 of documents up to 34 tokens). Windows
and chunks are 16 tokens; every document is cut into 4 chunks over the ring sub-group (6 to 10 tokens), so
each window's halo crosses every ring boundary of its document, from one or two chunks back.
"""

from __future__ import annotations

import copy

import torch

from tests.workers.cp_steps import reduce_over_group
from tests.workers.exact_norms import norms_in_input_dtype
from tests.workers.layer_kinds_worker import _docs, _reference, default_dtype, grad_errors
from tests.workers.thd_attention_worker import _ce, pack

ULYSSES = 2
#: two packed rows; padded to 8 (2 * cp) the documents are 24, 40, 16 and 32, 24 tokens
ROWS = [[21, 34, 9], [30, 18]]
FAMILIES = ("mistral", "gpt_oss", "gemma2", "deepseek_v3", "llama4_temperature", "deepseek_v32_dense", "glm_moe_dsa_dense",
            "hy_v4_dense", "axk2_dense", "qwen4_exp_text_qsa", "kolibri1_1_shared",
            "zaya_bias")
#: Gemma 4 in fp64 with its RMSNorms in fp64 (tests/workers/exact_norms.py): per-layer-type RoPE and head sizes,
#: sliding and full layers, per-layer inputs; scores unscaled (scaling 1.0 after the q/k norms)
CASES = [(family, dtype) for family in FAMILIES for dtype in ("float32", "float64")] + [("gemma4_text", "float64")]
#: ALiBi in BLOOM's own attention code (cp/layers/alibi.py), handed to usp: each Ulysses rank's head slopes
CASES += [("bloom", "float32"), ("bloom", "float64")]
#: GPT-Neo's global and local-window masks in its own code (cp/layers/alibi.py), handed to usp with its window
CASES += [("gpt_neo", "float32"), ("gpt_neo", "float64")]
#: Falcon with alibi=True: its bf16 ALiBi for each Ulysses rank's heads, the key's in-document position
CASES += [("falcon_alibi", "float32"), ("falcon_alibi", "float64")]
#: Doge's dynamic mask attention (K and V gathered over both sub-groups, top-k 8 per document): A ~ N(0, 1), and A = 0
#: (every bias 1, the top-k all ties); fp64 with its RMSNorms in fp64
CASES += [("doge_random_A", "float32"), ("doge_random_A", "float64"), ("doge", "float64")]
#: GPT-NeoX-Japanese, OpenAI GPT, XGLM: causal attention in their own code, handed to usp (cp/layers/alibi.py)
CASES += [(family, dtype) for family in ("gpt_neox_japanese", "openai-gpt", "xglm") for dtype in ("float32", "float64")]
#: DeepSeek-V4: window + sinks, HCA and CSA layers (layer_kinds_worker.V4_CONFIG), sinks, pooling biases
#: and hash routing drawn afresh
CASES += [("deepseek_v4", "float32"), ("deepseek_v4", "float64")]
#: HY-V4: its hyper-connections in fp64; Doge: its RMSNorms; DeepSeek-V4: its norms, RoPE, hyper-connections and
#: pooling; Qwen4-Exp, Kolibri-1.1, ZAYA: their RMSNorms (exact_norms.py)
EXACT_NORMS = ("gemma4_text", "hy_v4_dense", "doge_random_A", "doge", "deepseek_v4", "qwen4_exp_text_qsa",
               "kolibri1_1_shared", "zaya_bias")

#: the family-matrix row (or variant, tests/family_matrix.py) each case's model is built from, where not its name
ROWS_OF = {"llama4_temperature": "llama4_text", "falcon_alibi": "falcon@alibi", "doge_random_A": "doge",
           "qwen4_exp_text_qsa": "qwen4_exp_text@qsa", "kolibri1_1_shared": "kolibri1_1@shared", "zaya_bias": "zaya@bias"}


def row_of(family: str) -> str:
    """The family-matrix row (``<row>[@<variant>]``) of a case's ``family``."""
    return ROWS_OF.get(family, family.removesuffix("_dense"))


def launched(family: str) -> bool:
    """Whether the launch runs ``family`` on the installed transformers: the release has its row, and it is not
    Falcon before 5.25 (its own attention code, refused: tests/test_usp.py checks the refusal instead)."""
    from tests.family_matrix import absent_reason, falcon_refused

    row = row_of(family)
    return absent_reason(row) is None and not (row.split("@")[0] == "falcon" and falcon_refused())


def _model(family: str, dtype: torch.dtype):
    from tests.family_matrix import family_by_name

    if family == "llama4_temperature":
        from transformers import AutoModelForCausalLM

        fam = family_by_name("llama4_text")
        config = fam.build_config()
        config.attn_temperature_tuning, config.floor_scale = True, 4  # layer 1 (NoPE) scales its queries
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation(), dtype=torch.float32).train()
    elif family == "falcon_alibi":
        from tests.workers.layer_kinds_worker import build_case_model

        model = build_case_model({"family": "falcon", "config": {"alibi": True}})
    elif family == "doge_random_A":
        from tests.workers.layer_kinds_worker import build_case_model

        model = build_case_model({"family": "doge", "random_A": True})
    elif family == "deepseek_v4":
        from tests.workers.layer_kinds_worker import V4_CONFIG, V4_RANDOM, build_case_model, randomize

        model = build_case_model({"family": family, "config": V4_CONFIG})
        randomize(model, V4_RANDOM)
    elif family == "qwen4_exp_text_qsa":  # QSA layers only, one routed expert (layer_kinds_worker.QSA_CONFIG)
        from tests.workers.layer_kinds_worker import QSA_CONFIG, build_case_model

        model = build_case_model({"family": "qwen4_exp_text", "config": QSA_CONFIG})
    elif family == "kolibri1_1_shared":  # indexed layers sharing a pool and K/V (layer_kinds_worker.KOLIBRI_CONFIG)
        from tests.workers.layer_kinds_worker import KOLIBRI_CONFIG, build_case_model

        model = build_case_model({"family": "kolibri1_1", "config": KOLIBRI_CONFIG})
    elif family == "zaya_bias":  # ZAYA's CCA with value biases and a 3 + 2 tap conv (cp/layers/cca.py)
        from tests.workers.layer_kinds_worker import build_case_model

        model = build_case_model({"family": "zaya", "config": {"attention_bias": True, "cca_time0": 3, "cca_time1": 2}})
    elif family.endswith("_dense"):  # DSA with every MLP dense (no fp32 router): fp64 shows fp64's round-off
        from tests.workers.layer_kinds_worker import build_case_model

        model = build_case_model({"family": family.removesuffix("_dense"), "dense_mlp": True})
    else:
        model = family_by_name(family).build_model(0)
    if dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    return model.to(dtype)


def _usp_step(model, mesh, batch, n_labels: int) -> tuple[float, dict, str]:
    from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx, set_usp_attention

    set_usp_attention(model)
    model.zero_grad(set_to_none=True)
    ctx, local = make_usp_batch_and_ctx(mesh, batch, ulysses_size=ULYSSES)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        ce = _ce(logits.flatten(0, 1), local["labels"].flatten())
        (ce / n_labels).backward()
    loss, grads = reduce_over_group(model, ce, mesh["cp"].get_group())
    return float(loss) / n_labels, grads, model.config._attn_implementation


def layer_kind_cases(mesh, world_size: int) -> dict:
    """``{(family, dtype): {loss_rel, grad_rel, missing, attn}}`` for :data:`CASES` (every rank calls it)."""
    out = {}
    for family, dtype_name in CASES:
        if not launched(family):
            continue
        dtype = getattr(torch, dtype_name)
        # XGLM clamps its scores with a tensor of torch's default dtype: fp64 for its fp64 case
        with norms_in_input_dtype(family in EXACT_NORMS and dtype == torch.float64), \
                default_dtype({"default_dtype": dtype_name} if family == "xglm" else {}):
            out[(family, dtype_name)] = _case(family, dtype, mesh, world_size)
    return out


def _case(family: str, dtype: torch.dtype, mesh, world_size: int) -> dict:
    from tests.family_matrix import VOCAB

    base = _model(family, dtype)
    rows = [_docs(lengths, VOCAB, seed=5 + i) for i, lengths in enumerate(ROWS)]
    docs = [d for row in rows for d in row]
    n_labels = sum(int((d["labels"] != -100).sum()) for d in docs)
    ref_loss, ref_grads = _reference(copy.deepcopy(base), docs, n_labels)
    loss, grads, attn = _usp_step(copy.deepcopy(base), mesh, pack(rows, 2 * world_size), n_labels)
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), **grad_errors(grads, ref_grads), "attn": attn}
