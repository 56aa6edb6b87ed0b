"""The errors a caller sees for an input the library refuses.

Inputs are checked once, where they enter: the `Model` API (`lookm_jax.inputs`), method
construction (`lookm_jax.compression.methods`) and the `lookm` command. Each message names the value as it
was given and the range that is accepted; the CLI prints it as one line and exits 2.
"""

from __future__ import annotations

MAX_SEED = 2**32 - 1  # seeds are ints in [0, MAX_SEED]: `Model.run` and every --seed
PARAM_DTYPES = ("float32", "bfloat16")  # what `load`, `Model.astype` and every --dtype accept


class InputError(ValueError):
    """A value given to the API or the CLI is outside what it accepts."""


class PromptTooLongError(InputError):
    """The prompt does not fit the largest prompt bucket."""
