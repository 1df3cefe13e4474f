"""The one exception type for mistakes in what a user gave us.

Raise :class:`UserInputError` (a ``ValueError``) for a problem in the config, a data file, the
tokenizer, the model path or a checkpoint: the message names the value, the rule and the fix. The
recipe prints it as one ``error: ...`` line from rank 0 and exits with code 2; any other exception
is a programming error and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["CPUnsupportedError", "UserInputError"]


class UserInputError(ValueError):
    """A mistake in the user's input (config, data, tokenizer, model path, checkpoint).

    The message is complete on its own: what is wrong, where (file, line, key) and how to fix it.
    """

    #: a refusal of a CP method: the methods its message names as running the model instead (labels such
    #: as ``ring`` or ``usp (ulysses_size=2)``); empty where none is named
    alternatives: tuple[str, ...] = ()


class CPUnsupportedError(UserInputError):
    """A model has a layer kind the chosen CP method does not compute exactly (it would train wrong).

    Raised before any weight loads in the recipe, and when the model is prepared (or at the latest at
    its first forward inside the CP context) in the own-loop API. The message names the layer kind, the
    layer indices, the method, and the methods that would run the model exactly.
    """
