"""Context-parallel methods as strategies, their registry, and the model profile they read.

- :mod:`.method`: the interface a method declares (:class:`CPMethod`);
- :mod:`.registry`: name -> method (:func:`get_cp_method`, :func:`register_cp_method`) and the one
  exactness check (:func:`check_model_for_cp`);
- :mod:`.profile`: :func:`profile_model`, each decoder layer's mixer kind;
- :mod:`.ring`, :mod:`.ulysses`, :mod:`.thd`, :mod:`.thd_docs`, :mod:`.usp`: the built-in methods (registered here);
- :mod:`.thd_docs.placement`: the document placement planner of ``thd_docs`` (a pure function of the lengths);
- :mod:`.cost`: a method's exchange per attention layer inside and across nodes (:func:`exchange_cost`), the
  one cost model ``auto``, the dry run's step estimate and the layout rankings read;
- :mod:`.choose`: ``cp_method: auto``, the method that computes a model exactly at the least communication
  (:func:`choose_cp_method`, from each method's own checks);
- :mod:`.bind`: prepare a model for a method and get its batch function (the recipe's one call);
- :mod:`.group`: the one place the CP process group is resolved;
- :mod:`.guard`: the own-loop check at a model's first forward inside a CP context;
- :mod:`.context`: :func:`context_parallel`, the one own-loop entry point of every method (imported on
  first use of the name).

Importing this package imports neither torch.distributed nor transformers: the config rules read it.
"""

from automodel.distributed.cp.choose import AUTO, Choice, choose_cp_method
from automodel.distributed.cp.cost import ExchangeCost, exchange_cost
from automodel.distributed.cp.method import CPMethod, PreparedModel, profile_problems
from automodel.distributed.cp.profile import LayerSpec, ModelProfile, profile_model
from automodel.distributed.cp.registry import (
    check_model_config_for_cp,
    check_model_for_cp,
    cp_methods,
    get_cp_method,
    methods_that_run,
    register_cp_method,
    unregister_cp_method,
)
from automodel.distributed.cp.ring import RingMethod
from automodel.distributed.cp.thd import ThdMethod
from automodel.distributed.cp.thd_docs import ThdDocsMethod
from automodel.distributed.cp.ulysses import UlyssesMethod
from automodel.distributed.cp.usp import UspMethod

for _method in (RingMethod(), UlyssesMethod(), ThdMethod(), ThdDocsMethod(), UspMethod()):
    if _method.name not in cp_methods():
        register_cp_method(_method)

__all__ = [
    "AUTO",
    "Choice",
    "choose_cp_method",
    "ExchangeCost",
    "exchange_cost",
    "ContextParallel",
    "context_parallel",
    "CPMethod",
    "PreparedModel",
    "LayerSpec",
    "ModelProfile",
    "profile_model",
    "profile_problems",
    "check_model_for_cp",
    "check_model_config_for_cp",
    "cp_methods",
    "get_cp_method",
    "methods_that_run",
    "register_cp_method",
    "unregister_cp_method",
]


def __getattr__(name: str) -> object:
    """``context_parallel`` / ``ContextParallel`` from :mod:`.context`, imported on first use (it imports
    torch.distributed, which this package does not at import time)."""
    if name in ("context_parallel", "ContextParallel"):
        from automodel.distributed.cp import context

        return getattr(context, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
