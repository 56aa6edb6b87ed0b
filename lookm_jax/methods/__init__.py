"""Registry of compression methods; the test suite parametrises over ``METHODS``."""

from __future__ import annotations

from lookm_jax.methods.base import AttentionMethod, BudgetMethod, Method
from lookm_jax.methods.full import Full
from lookm_jax.methods.h2o import H2O
from lookm_jax.methods.lookm import LookM
from lookm_jax.methods.roco import RoCo
from lookm_jax.methods.snapkv import SnapKV
from lookm_jax.methods.streamingllm import StreamingLLM

_REGISTRY: dict[str, type[Method]] = {
    "full": Full,
    "streamingllm": StreamingLLM,
    "h2o": H2O,
    "snapkv": SnapKV,
    "roco": RoCo,
    "lookm": LookM,
}
METHODS: tuple[str, ...] = tuple(_REGISTRY)


def get_method(name: str, *, budget: float | None = None, **kwargs) -> Method:
    """Build a method by name; kwargs are its dataclass fields.

    ``budget`` (every method but "full"): the kept fraction of the prompt, split evenly into
    alpha_recent = alpha_important = budget / 2 (so M + N may be one slot under budget * L).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    cls = _REGISTRY[name]
    if budget is not None:
        if not issubclass(cls, BudgetMethod):
            raise ValueError(f"method {name!r} takes no budget")
        if {"alpha_recent", "alpha_important"} & kwargs.keys():
            raise ValueError("give either budget or alpha_recent / alpha_important, not both")
        kwargs.update(alpha_recent=budget / 2, alpha_important=budget / 2)
    return cls(**kwargs)


__all__ = ["METHODS", "AttentionMethod", "BudgetMethod", "Full", "H2O", "LookM", "Method", "RoCo", "SnapKV",
           "StreamingLLM", "get_method"]
