"""RMSNorms in the input's dtype, so that an fp64 model is fp64 end to end (the fp64 parity cases of the Gemma families).

Gemma 3, Gemma 3n and Gemma 4 compute every RMSNorm in fp32 whatever the model's dtype (``x.float()``, then
``.type_as(x)``): an fp64 model keeps fp32 round-off in each norm, so CP against one process agrees to ~1e-7 there,
not to fp64's ~1e-15, and a leak of 1e-7 would hide under it. Inside :func:`norms_in_input_dtype` those norms compute
the same formula in the input's dtype (the classes are patched for the duration; instances keep their weights), so
the fp64 cases prove the CP path exact to fp64 round-off. fp32 models compute exactly as transformers does.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

#: (module, class, the weight's offset: Gemma 3 scales by ``1 + weight``, Gemma 3n and 4 by ``weight``)
NORMS = (
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm", 1.0),
    ("transformers.models.gemma3n.modeling_gemma3n", "Gemma3nRMSNorm", 0.0),
    ("transformers.models.gemma4.modeling_gemma4", "Gemma4RMSNorm", 0.0),
)


def _forward(offset: float):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._norm(x)
        weight = getattr(self, "weight", None) if getattr(self, "with_scale", True) else None
        return out if weight is None else out * (offset + weight)

    return forward


@contextlib.contextmanager
def norms_in_input_dtype(enabled: bool = True) -> Iterator[None]:
    """Patch the Gemma RMSNorm classes of :data:`NORMS` (those the installed transformers has) to compute in the
    input's dtype; restored on exit. ``enabled=False``: nothing changes."""
    saved = []
    try:
        if enabled:
            for module_name, class_name, offset in NORMS:
                try:
                    cls = getattr(importlib.import_module(module_name), class_name)
                except (ImportError, AttributeError):
                    continue
                saved.append((cls, cls.forward))
                cls.forward = _forward(offset)
        yield
    finally:
        for cls, forward in saved:
            cls.forward = forward
