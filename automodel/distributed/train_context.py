"""The context every forward+backward of the recipe runs in (loss parallel, compiled autograd, a CP context).

Shared by every CP method and by runs without CP; NeMo AutoModel's seed path
``automodel.distributed.cp_utils.get_train_context`` re-exports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["get_train_context"]


def get_train_context(
    enable_loss_parallel: bool,
    enable_compiled_autograd: bool,
    cp_context: contextlib.AbstractContextManager | None = None,
    *,
    compiled_autograd_backend: str = "inductor",
    attention_backend: str = "auto",
    device_type: str = "cuda",
    cudnn_packed_blocks: bool = True,
) -> Callable[[], contextlib.AbstractContextManager]:
    """Return a factory of the context every forward+backward runs in: ``with train_ctx(): ...``.

    Args:
        enable_loss_parallel: enter ``torch.distributed.tensor.parallel.loss_parallel()`` (TP with a
            sharded vocabulary).
        enable_compiled_autograd: run the backward through compiled autograd
            (:func:`automodel.distributed.compiled_autograd.compiled_autograd`: no fullgraph, static
            shapes). FSDP2's gradient hooks do not run under it on torch 2.13: use a replicated model
            (:mod:`automodel.distributed.replicate`).
        cp_context: a context from :func:`create_context_parallel_ctx` (single use: each CP batch
            needs a fresh one, which :func:`make_cp_batch_and_ctx` provides).
        attention_backend: ``model.attention_backend``; on a ``device_type`` ``"cuda"`` run a pinned kernel runs
            every attention call, and ``auto`` sets SDPA's priority to the block kernels' rule
            (:func:`automodel.distributed.cp.attention_kernels.attention_backend_context`).
        cudnn_packed_blocks: ``model.cudnn_packed_blocks``; ``False`` runs thd's, thd_docs' and usp's block sets one
            cuDNN call per block (:func:`automodel.distributed.cp.attention_kernels.packed_blocks_context`).
    """

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if enable_loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if enable_compiled_autograd:
                from automodel.distributed.compiled_autograd import compiled_autograd

                stack.enter_context(compiled_autograd(compiled_autograd_backend))
            if device_type == "cuda" or attention_backend != "auto":  # auto on CUDA: SDPA's order is the blocks'
                from automodel.distributed.cp.attention_kernels import attention_backend_context

                stack.enter_context(attention_backend_context(attention_backend, device_type))
            if not cudnn_packed_blocks:
                from automodel.distributed.cp.attention_kernels import packed_blocks_context

                stack.enter_context(packed_blocks_context(False))
            if cp_context is not None:
                stack.enter_context(cp_context)
            yield

    return context
