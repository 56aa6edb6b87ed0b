"""Chat templates rendered the way Hugging Face renders them, without transformers."""

from __future__ import annotations

import functools
import json

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lookm_jax.errors import InputError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # passed to a template by name, as HF does


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF overrides jinja's tojson, which would HTML-escape the text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Templates come from model files: untrusted code, hence the sandbox. Same options as HF.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def special_tokens_of(tokenizer_config: dict) -> dict[str, str]:
    """The SPECIAL_TOKENS a tokenizer_config.json or special_tokens_map.json names (each a string or an
    AddedToken's {"content": ...})."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = tokenizer_config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def apply_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                        special_tokens: dict[str, str] | None = None) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with a jinja chat template, as text;
    `special_tokens` ({"bos_token": "<s>", ...}) are the template's variables of those names."""
    if not isinstance(template, str) or not template:
        raise ValueError("apply_chat_template needs a non-empty jinja template string")
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **(special_tokens or {}))
    except jinja2.TemplateError as error:  # a syntax error, an undefined variable, the template's raise_exception
        raise InputError(f"the model's chat template failed: {error}") from None
