"""Registry of compression methods; the test suite parametrises over ``METHODS``."""

from __future__ import annotations

import dataclasses

from lookm_jax.checks import is_real
from lookm_jax.errors import InputError
from lookm_jax.compression.methods.base import Method, ScorerMethod
from lookm_jax.compression.methods.full import Full
from lookm_jax.compression.methods.h2o import H2O
from lookm_jax.compression.methods.lookm import LookM
from lookm_jax.compression.methods.lookm_quota import LookMQuota
from lookm_jax.compression.methods.roco import RoCo
from lookm_jax.compression.methods.snapkv import AdaKV, PyramidKV, SnapKV
from lookm_jax.compression.methods.streamingllm import StreamingLLM

_REGISTRY: dict[str, type[Method]] = {
    "full": Full,
    "streamingllm": StreamingLLM,
    "h2o": H2O,
    "snapkv": SnapKV,
    "pyramidkv": PyramidKV,
    "adakv": AdaKV,
    "roco": RoCo,
    "lookm": LookM,
    "lookm_quota": LookMQuota,
}
METHODS: tuple[str, ...] = tuple(_REGISTRY)


def parameters(name: str) -> dict[str, object]:
    """A method's parameters (its dataclass fields) and their defaults, in declaration order."""
    return {f.name: f.default for f in dataclasses.fields(method_class(name))}


def method_class(name: str) -> type[Method]:
    """The class registered as `name`."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise InputError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return _REGISTRY[name]


def get_method(name: str, *, budget: float | None = None, recent_share: float | None = None, **kwargs) -> Method:
    """Build a method by name; kwargs are its dataclass fields (``parameters(name)``).

    ``budget`` (every method but "full"): the kept fraction of the prompt, in (0, 1], split into
    alpha_recent = recent_share * budget and alpha_important = the rest (so M + N may be one slot under
    budget * L). ``recent_share`` in [0, 1], with a budget only: default the method's ``RECENT_SHARE``
    (0.5, an even split, for every method this project did not define).
    """
    cls = method_class(name)
    accepted = parameters(name)
    scorer = issubclass(cls, ScorerMethod)
    unknown = sorted(kwargs.keys() - accepted.keys()) + [k for k, v in (("budget", budget), ("recent_share", recent_share))
                                                         if v is not None and not scorer]
    if unknown:
        raise InputError(f"method {name!r} takes no {', '.join(unknown)} (its parameters: "
                         f"{', '.join(accepted) or 'none'})")
    if recent_share is not None and budget is None:
        raise InputError("recent_share splits a budget: give budget too")
    if budget is not None:
        if not is_real(budget) or not 0 < budget <= 1:
            shown = f"{budget:g}" if is_real(budget) else repr(budget)  # as typed: -1, not -1.0
            raise InputError(f"budget must be a fraction in (0, 1], got {shown}")
        if {"alpha_recent", "alpha_important"} & kwargs.keys():
            raise InputError("give either budget or alpha_recent / alpha_important, not both")
        share = cls.RECENT_SHARE if recent_share is None else recent_share
        if not is_real(share) or not 0 <= share <= 1:
            raise InputError(f"recent_share must be a fraction in [0, 1], got {share!r}")
        kwargs.update(alpha_recent=budget * share, alpha_important=budget * (1 - share))
    return cls(**kwargs)


__all__ = ["METHODS", "AdaKV", "Full", "H2O", "LookM", "LookMQuota", "Method", "PyramidKV", "RoCo", "ScorerMethod",
           "SnapKV", "StreamingLLM", "get_method", "method_class", "parameters"]
