"""How much padding a sequence needs so that CP, TP sequence parallelism and FP8 all split it cleanly.

Each enabled feature puts a divisibility constraint on the (padded) sequence length ``S``:

* **CP** (``cp_size > 1``): load-balanced CP cuts ``S`` into ``2*cp`` equal chunks: ``S % (2*cp) == 0``.
* **TP sequence parallelism** (``has_sp`` and ``tp_size > 1``): the tokens a rank holds are split across
  the ``tp`` ranks. Without CP: ``S % tp == 0``. With CP every one of the ``2*cp`` load-balanced
  chunks is split across ``tp`` (the Megatron convention): ``S % (2*cp*tp) == 0``.
* **FP8** (``fp8_enabled``): FP8 GEMMs need the token count each rank feeds them to be a multiple of
  16 (32 for the ``"mxfp8"`` recipe, whose scaling blocks are 32 long). A rank holds
  ``S / (cp * tp_sp)`` tokens (``tp_sp = tp`` with sequence parallelism, else 1), so
  ``S % (align * cp * tp_sp) == 0``.

The constraints are combined by **least common multiple**, so every one of them holds at once (a
product would over-pad, and picking one rule, as some references do, silently drops the others, e.g.
FP8 alignment under CP). :func:`get_padding_lcm` applies this rule; :func:`get_padding` keeps Megatron's
name, signature and values (ONE rule, the first that applies: CP+SP, CP, SP, FP8), so ported code
pads exactly as before. Examples of the lcm rule: ``(S=99, cp=2, tp=2, sp)`` -> multiple 8, padding 5;
``(S=99, cp=2)`` -> multiple 4, padding 1; ``(S=99, fp8)`` -> multiple 16, padding 13;
``(S=99, cp=2, fp8)`` -> lcm(4, 32) = 32, padding 29.
"""

from __future__ import annotations

import math

__all__ = ["get_padding", "get_padding_lcm", "get_padding_multiple", "FP8_RECIPES"]

#: FP8 recipe names accepted by :func:`get_padding` (``None`` = the default recipe).
FP8_RECIPES = (None, "delayed", "tensorwise", "blockwise", "mxfp8")


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}")


def _fixed_length_padding(seq_len: int, decoder_seq_len: int | None) -> int:
    """Padding up to the fixed ``decoder_seq_len`` that TP communication overlap needs (``ValueError`` if unusable)."""
    if decoder_seq_len is None:
        raise ValueError("decoder_tp_comm_overlap=True needs decoder_seq_len (the fixed padded decoder length); pass it")
    if decoder_seq_len < seq_len:
        raise ValueError(f"decoder_seq_len={decoder_seq_len} is shorter than seq_len={seq_len}")
    return decoder_seq_len - seq_len


def get_padding_multiple(
    cp_size: int = 1,
    tp_size: int = 1,
    has_sp: bool = False,
    fp8_enabled: bool = False,
    fp8_recipe: str | None = None,
) -> int:
    """The smallest ``m`` such that every sequence length divisible by ``m`` meets all the constraints above."""
    cp_size = _positive_int("cp_size", cp_size)
    tp_size = _positive_int("tp_size", tp_size)
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {FP8_RECIPES}, got {fp8_recipe!r}")
    sp = has_sp and tp_size > 1
    terms = [1]
    if cp_size > 1:
        terms.append(2 * cp_size)
    if sp:
        terms.append(2 * cp_size * tp_size if cp_size > 1 else tp_size)
    if fp8_enabled:
        align = 32 if fp8_recipe == "mxfp8" else 16
        terms.append(align * cp_size * (tp_size if sp else 1))
    return math.lcm(*terms)


def get_padding(
    seq_len: int, cp_size: int = 1, tp_size: int = 1, has_sp: bool = False, decoder_tp_comm_overlap: bool = False,
    decoder_seq_len: int | None = None, fp8_enabled: bool = False, fp8_recipe: str | None = None,
) -> int:
    """Megatron's ``get_padding``: padding for SP, CP, TP comm overlap or FP8, by the first rule that applies.

    The padded length is a multiple of ``2*cp*tp`` (CP with SP), else ``2*cp`` (CP), else ``tp`` (SP),
    else 16 (FP8; 32 for ``"mxfp8"``). With ``has_sp and decoder_tp_comm_overlap`` it is
    ``decoder_seq_len - seq_len``. ``cp_size``, ``tp_size`` and ``has_sp`` are required in Megatron and
    default to 1/1/False here.

    Difference (why :func:`get_padding_lcm` exists): the rules are exclusive, so FP8 alignment is
    dropped under CP or SP (``get_padding(99, 2, 1, False, fp8_enabled=True) == 1``: 50 tokens per
    rank, not a multiple of 16, and FP8 GEMMs reject them). Use :func:`get_padding_lcm` to meet every
    constraint at once (29 there).

    Raises:
        ValueError: a negative ``seq_len``, a size < 1, a missing ``decoder_seq_len`` with comm overlap,
        or a ``decoder_seq_len`` shorter than ``seq_len`` (negative padding).
    """
    _check_seq_len(seq_len)
    cp_size = _positive_int("cp_size", cp_size)
    tp_size = _positive_int("tp_size", tp_size)
    if has_sp and decoder_tp_comm_overlap:
        return _fixed_length_padding(seq_len, decoder_seq_len)
    if has_sp and cp_size > 1:
        factor = tp_size * cp_size * 2
    elif cp_size > 1:
        factor = cp_size * 2
    elif has_sp:
        factor = tp_size
    elif fp8_enabled:
        factor = 32 if fp8_recipe == "mxfp8" else 16
    else:
        factor = 1
    return (-seq_len) % factor


def get_padding_lcm(
    seq_len: int, cp_size: int = 1, tp_size: int = 1, has_sp: bool = False, decoder_tp_comm_overlap: bool = False,
    decoder_seq_len: int | None = None, fp8_enabled: bool = False, fp8_recipe: str | None = None,
) -> int:
    """Padding that meets EVERY constraint (CP, SP, FP8) at once: the lcm rule of the module docstring.

    Args:
        seq_len: unpadded sequence length (>= 0).
        cp_size, tp_size: context- and tensor-parallel sizes (>= 1).
        has_sp: the model uses TP sequence parallelism.
        decoder_tp_comm_overlap: TP communication overlap is on, which needs a fixed sequence length:
            the padding is then ``decoder_seq_len - seq_len`` (``decoder_seq_len`` is required, must be
            ``>= seq_len`` and must itself meet the constraints). Only meaningful with ``has_sp``.
        decoder_seq_len: the fixed (padded) decoder length for ``decoder_tp_comm_overlap``.
        fp8_enabled, fp8_recipe: FP8 training and its recipe (``"mxfp8"`` needs 32-token alignment).

    Returns:
        ``pad >= 0`` with ``(seq_len + pad) % get_padding_multiple(...) == 0`` (the smallest such pad,
        except with ``decoder_tp_comm_overlap``).
    """
    _check_seq_len(seq_len)
    multiple = get_padding_multiple(cp_size, tp_size, has_sp, fp8_enabled, fp8_recipe)
    if has_sp and decoder_tp_comm_overlap:
        pad = _fixed_length_padding(seq_len, decoder_seq_len)
        if decoder_seq_len % multiple != 0:
            raise ValueError(
                f"decoder_seq_len={decoder_seq_len} is not divisible by {multiple} (required by cp_size={cp_size}, "
                f"tp_size={tp_size}, has_sp={has_sp}, fp8_enabled={fp8_enabled}, fp8_recipe={fp8_recipe!r}); "
                f"use {-(-decoder_seq_len // multiple) * multiple}"
            )
        return pad
    return (-seq_len) % multiple
