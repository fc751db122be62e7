"""Which model code serves a checkpoint: SGLang's ``--model-impl``, with the built-in decoder as "native".

A module of its own, free of torch, so that the command line can offer the choices without importing the engine.
"""

from __future__ import annotations

from enum import Enum


class ModelImpl(str, Enum):
    """``auto`` serves natively where ``decoder`` implements the architecture exactly and through transformers
    otherwise; ``native`` refuses a checkpoint it cannot serve exactly; ``transformers`` always uses
    transformers' model and tokenizer (slower to start; the reference the native decoder is tested against).
    """

    AUTO = "auto"
    NATIVE = "native"
    TRANSFORMERS = "transformers"


MODEL_IMPL_CHOICES = tuple(impl.value for impl in ModelImpl)


class ModelImplError(ValueError):
    """``--model-impl native`` asked for a checkpoint the native decoder does not serve exactly."""
