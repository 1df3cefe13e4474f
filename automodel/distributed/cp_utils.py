"""The public context-parallel (CP) API, NeMo AutoModel's ``cp_utils`` names (re-exports only).

The code lives in :mod:`automodel.distributed.cp.ring.batch` (ring CP's batch path) and
:mod:`automodel.distributed.te_batch` (the THD path, ``use_te=True``).
"""

from automodel.distributed.cp.ring.batch import (
    CP_PAD_VALUES,
    _build_position_ids,
    _shard_thd_chunk_for_te,
    cp_padded_seq_len,
    create_context_parallel_ctx,
    get_cp_mesh,
    get_train_context,
    make_cp_batch_and_ctx,
    make_cp_batch_for_te,
)

__all__ = [
    "_build_position_ids",
    "_shard_thd_chunk_for_te",
    "CP_PAD_VALUES",
    "cp_padded_seq_len",
    "create_context_parallel_ctx",
    "get_cp_mesh",
    "get_train_context",
    "make_cp_batch_and_ctx",
    "make_cp_batch_for_te",
]
