"""The user-facing model: config + params + tokenizer, with `logits`, `generate` and `run`.

Compiled programs are cached per static signature (bucket, batch, image count, method, budgets,
max_new_tokens, sampling): a new prompt length inside a bucket reuses them. `compile_count` says
how many were built, which is what the no-recompilation tests check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax import context as ctx_mod, generate as gen, inputs, sharding
from lookm_jax.cache import kept_by_modality
from lookm_jax.checks import as_int
from lookm_jax.errors import InputError
from lookm_jax.compression.methods import get_method
from lookm_jax.models import llama, llava, processors
from lookm_jax.models.config import LlamaConfig, LlavaConfig


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_logits(cfg: LlavaConfig | LlamaConfig, params: dict, input_ids: jax.Array, valid: jax.Array,
                   pixel_values: jax.Array | None) -> jax.Array:
    """[B, L] ids -> [B, L, V] fp32 logits, no cache. Static: cfg; L is the static bucket length."""
    x, is_image = llava.embed(cfg, params, input_ids, pixel_values)
    positions, _ = llava.rope_positions(cfg, input_ids, valid, pixel_values)
    h = llama.forward(llava.text_config(cfg), llava.decoder_params(params, is_image), x, valid, positions)
    return llama.lm_logits(params["text"], h)


@contextlib.contextmanager
def _out_of_memory_refused(shape: tuple[int, int], max_new_tokens: int, slots: int, full_bytes: int):
    """A run (compile included) that does not fit the device's memory raises one InputError line
    naming its cache, not XLA's RESOURCE_EXHAUSTED traceback."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise InputError(f"out of device memory: {shape[0]} prompt(s) in bucket {shape[1]} with max_new_tokens="
                         f"{max_new_tokens} need a KV cache of {slots} slots per row ({full_bytes / 2**30:.1f} GiB "
                         "uncompressed); lower max_new_tokens, the prompt's bucket or the batch") from None


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] int32; after EOS filled with the EOS id
    lengths: np.ndarray  # [B] tokens generated, EOS included
    prompt_lengths: np.ndarray  # [B] real prompt tokens
    image_tokens: np.ndarray  # [B] of which image placeholders
    kept_image_tokens: np.ndarray  # [B] image tokens the cache kept, mean over layers and KV heads
    kept_text_tokens: np.ndarray  # [B] text tokens the cache kept, likewise
    bucket: int
    prompt_slots: int  # prompt slots per row and KV head the method keeps in its largest layer: method.capacity(bucket)
    new_slots: int  # slots for the new tokens: max_new_tokens
    cache_bytes: int  # K/V bytes of the decode cache: (prompt_slots + new_slots) per layer, row and KV head
    full_cache_bytes: int  # the same for an uncompressed cache of this bucket: bucket + new_slots
    compile_seconds: float  # 0 when the programs were already compiled
    prefill_seconds: float  # prefill + compression (+ first token)
    decode_seconds: float  # the decode loop

    @property
    def decode_ms_per_token(self) -> float:
        steps = max(int(self.lengths.max()) - 1, 1)  # the first token comes from prefill
        return 1e3 * self.decode_seconds / steps


@dataclasses.dataclass
class Model:
    """A loaded model: a facade over the pieces that do the work. Input checks: `lookm_jax.inputs`;
    pictures and chat turns: the architecture's processor (`models/processors.py`); prefill, compression
    and decode: `lookm_jax.generate`; many methods from one prefill: `lookm_jax.sweep`."""

    config: LlavaConfig | LlamaConfig
    params: dict  # jax arrays; the layout: models/llama.py (runtime layout), clip.py, llava.py
    manifest: dict[str, Any]  # hf_config, chat_template, special_tokens, image_processor, notes (what `save` writes)
    tokenizer: Any = None  # tokenizers.Tokenizer
    buckets: tuple[int, ...] = gen.DEFAULT_BUCKETS
    mesh: jax.sharding.Mesh | None = None  # set by `shard`
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def text_config(self) -> LlamaConfig:
        return llava.text_config(self.config)

    @property
    def is_multimodal(self) -> bool:
        return llava.is_multimodal(self.config)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The chat template's bos_token / eos_token / ... strings (a folder converted before they were
        recorded has none)."""
        return self.manifest.get("special_tokens", {})

    @property
    def dtype(self):
        return self.params["text"]["embed"].dtype

    @property
    def compile_count(self) -> int:
        return len(self._compiled)

    def astype(self, dtype) -> "Model":
        """The same model with every parameter cast (e.g. jnp.bfloat16; `errors.PARAM_DTYPES`)."""
        inputs.check_dtype(dtype)
        params = jax.tree.map(lambda a: a.astype(dtype), self.params)
        return dataclasses.replace(self, params=params, _compiled={})

    def shard(self, mesh: jax.sharding.Mesh) -> "Model":
        """The same model laid out on a (data, model) mesh (`lookm_jax.sharding.make_mesh`): params
        tensor-parallel over "model", and every call shards its rows over "data" (the batch must
        divide evenly) and the KV cache's heads over "model"."""
        if not isinstance(mesh, jax.sharding.Mesh):
            raise InputError(f"shard takes a jax.sharding.Mesh (lookm_jax.make_mesh), got {type(mesh).__name__}")
        sharding.check_mesh(mesh, self.text_config.num_kv_heads)
        return dataclasses.replace(self, params=sharding.shard_params(self.params, mesh), mesh=mesh, _compiled={})

    def _rows(self, *arrays: np.ndarray) -> list[jax.Array]:
        """[B, ...] host arrays on the device, or split over the mesh's "data" axis."""
        return [jnp.asarray(a) for a in arrays] if self.mesh is None else sharding.place_rows(self.mesh, *arrays)

    # ---- public API ---------------------------------------------------------------------------
    def logits(self, input_ids, pixel_values=None, attention_mask=None, *,
               ignore_context_limit: bool = False) -> np.ndarray:
        """HF-style forward: [B, L] ids -> [B, L, V] float32 logits (positions 0..L-1, mask on keys)."""
        ids, valid = inputs.forward_ids(self, input_ids, attention_mask, ignore_context_limit)
        length = ids.shape[1]
        bucket = gen.bucket_length(length, self.buckets)
        pad = ((0, 0), (0, bucket - length))
        pixels = inputs.pixel_values(self.config, self.dtype, ids, valid, pixel_values)
        out = forward_logits(self.config, self.params, *self._rows(np.pad(ids, pad), np.pad(valid, pad)), pixels)
        return np.asarray(out[:, :length])

    def generate(self, input_ids, pixel_values=None, attention_mask=None, max_new_tokens: int = 32,
                 **kwargs) -> np.ndarray:
        """-> new tokens [B, max_new_tokens] int32 (greedy by default). kwargs as for `run`."""
        return self.run(input_ids, pixel_values, attention_mask, max_new_tokens, **kwargs).tokens

    def run(self, input_ids, pixel_values=None, attention_mask=None, max_new_tokens: int = 32, *,
            method=None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
            ignore_context_limit: bool = False) -> GenerationResult:
        """Generate with timings and cache sizes. `method`: a compression method object (see
        `lookm_jax.get_method`) or None for the full cache. Prompts may be left- or right-padded.
        Prompt + max_new_tokens must fit the model's context (max_position_embeddings) unless
        `ignore_context_limit`; every refused input raises `lookm_jax.InputError`."""
        method = get_method("full") if method is None else method
        prompt = inputs.prepare(self, input_ids, pixel_values, attention_mask, max_new_tokens, [method],
                                ignore_context_limit)
        ids, valid, pixels = prompt.ids, prompt.valid, prompt.pixel_values
        sampling = gen.Sampling(temperature, top_p)
        inputs.check_seed(seed)
        key = jax.random.key(seed)
        args = (self.config, self.params, *self._rows(ids, valid), pixels, key)
        cfg = self.text_config
        full_bytes = (2 * cfg.num_layers * ids.shape[0] * cfg.num_kv_heads * (ids.shape[1] + max_new_tokens)
                      * cfg.head_dim * jnp.dtype(self.dtype).itemsize)
        prompt_slots = method.capacity(ids.shape[1])
        with _out_of_memory_refused(ids.shape, max_new_tokens, prompt_slots + max_new_tokens, full_bytes):
            prefill, decode, compile_seconds = self._programs(args, method, max_new_tokens, sampling)
            dynamic = args[1:]
            start = time.perf_counter()
            first, cache, is_image = jax.block_until_ready(prefill(*dynamic))
            prefill_seconds = time.perf_counter() - start
            cache_bytes = cache.nbytes
            kept_image, kept_text = kept_by_modality(cache.positions, is_image)  # before decode donates the cache
            start = time.perf_counter()
            tokens, lengths, _ = jax.block_until_ready(decode(self.params["text"], first, cache, key))
            decode_seconds = time.perf_counter() - start
        return GenerationResult(
            tokens=np.asarray(tokens), lengths=np.asarray(lengths), prompt_lengths=valid.sum(1),
            image_tokens=(np.asarray(is_image) & valid).sum(1), kept_image_tokens=np.asarray(kept_image),
            kept_text_tokens=np.asarray(kept_text), bucket=ids.shape[1],
            prompt_slots=prompt_slots, new_slots=max_new_tokens, cache_bytes=cache_bytes,
            full_cache_bytes=full_bytes, compile_seconds=compile_seconds, prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds)

    def prefill_context(self, input_ids, pixel_values=None, attention_mask=None, *, method=None,
                        ignore_context_limit: bool = False) -> ctx_mod.Context:
        """Encode and compress a context once (pictures and text, no question) -> a reusable
        `Context`; ask it questions with `ask`. Inputs as for `run`."""
        return ctx_mod.prefill_context(self, input_ids, pixel_values, attention_mask, method=method,
                                       ignore_context_limit=ignore_context_limit)

    def ask(self, context: ctx_mod.Context, question_ids, attention_mask=None, max_new_tokens: int = 32, *,
            temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, extend: bool = False,
            ignore_context_limit: bool = False) -> ctx_mod.Answer:
        """Prefill question ids [B, Q] onto `context` in one block and decode the answer; `context`
        stays reusable. `extend=True`: `Answer.context` continues the conversation. See
        `lookm_jax.context.ask`."""
        return ctx_mod.ask(self, context, question_ids, attention_mask, max_new_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, extend=extend, ignore_context_limit=ignore_context_limit)

    def _program(self, signature: tuple, lower) -> tuple[Any, float]:
        """The compiled program under `signature`, from `lower()` (a `jax.stages.Lowered`) on its
        first use, and the seconds compiling took now."""
        if signature in self._compiled:
            return self._compiled[signature], 0.0
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):  # None: no mesh
            self._compiled[signature] = lower().compile()
        return self._compiled[signature], time.perf_counter() - start

    def _programs(self, args: tuple, method, max_new_tokens: int, sampling: gen.Sampling):
        """The compiled prefill and decode of `run`'s arguments (compiled on their first call) and the
        seconds compiling took now."""
        _, _, ids, _, pixels, key = args  # (config, params, ids, valid, pixels, key)
        signature = (ids.shape, None if pixels is None else pixels.shape, method, max_new_tokens, sampling)
        if signature in self._compiled:
            return *self._compiled[signature], 0.0
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):  # None: no mesh
            prefill = gen.prefill.lower(*args, method=method, max_new_tokens=max_new_tokens,
                                        sampling=sampling).compile()
        first, cache, _ = prefill.out_info  # ShapeDtypeStructs with the compiled shardings
        decode = gen.decode.lower(self.text_config, self.params["text"], first, cache, key,
                                  max_new_tokens=max_new_tokens, sampling=sampling,
                                  eos_ids=self.text_config.eos_token_ids).compile()
        self._compiled[signature] = (prefill, decode)
        return prefill, decode, time.perf_counter() - start

    # ---- inputs -------------------------------------------------------------------------------
    @property
    def processor(self) -> processors.Processor:
        """This architecture's input processor (`models/processors.py`)."""
        return processors.processor(self.config, self.manifest.get("image_processor"))

    def preprocess_images(self, images: Sequence) -> tuple[np.ndarray, list[int] | None]:
        """Image files or PIL images -> (pixel_values [units, C, H, W], tiles per image or None).

        The checkpoint's own preprocessor: the CLIP processor (with LLaVA's pad-to-square when
        configured) or, for tiling architectures (InternVL), dynamic tiles; pass the tile counts to
        `encode_chat(..., image_tiles=...)`. Qwen2-VL and Qwen2.5-VL return (`qwen2_vl.Pixels`, each image's grid);
        pass the grids as `image_tiles`. LLaVA-NeXT returns (`llava_next.AnyresPixels`, each image's
        placeholder count); pass the counts as `image_tiles`. LLaVA-OneVision the same, for one prompt's
        images (tiled only when there is one; join prompts with `llava_next.concat_pixels`). A file that
        is not a readable image raises InputError.
        """
        if isinstance(images, (str, bytes, os.PathLike)) or not isinstance(images, Sequence) or not images:
            raise InputError(f"images must be a non-empty list of image files or PIL images, got {images!r:.80}")
        return self.processor.preprocess([inputs.open_image(i) for i in images])

    def encode_chat(self, prompt: str, num_images: int | None = None,
                    image_tiles: Sequence[int] | None = None) -> np.ndarray:
        """A user turn rendered with the model's chat template -> ids [1, L].

        `num_images` counts every image of the turn: "<image>" markers inside `prompt` place that
        many inline (MileBench-style interleaving), the rest go before the text; None (the
        default) means the markers place them all. More markers than `num_images` is refused.
        Every image expands to its placeholder tokens. Tiling architectures (InternVL) need
        `image_tiles`: each image's tile count, in order, from `preprocess_images`.
        """
        inline = prompt.count(processors.IMAGE_MARKER) if isinstance(prompt, str) else 0
        count = inline if num_images is None else as_int(num_images)
        if count is None or count < 0:
            raise InputError(f"num_images must be an int >= 0 or None, got {num_images!r}")
        if inline > count:
            raise InputError(f"the prompt has {inline} {processors.IMAGE_MARKER} markers but num_images={count}; "
                             "num_images counts all the turn's images (the markers place that many, the rest go "
                             "before the text)")
        num_images = count - inline
        if not isinstance(prompt, str):
            raise InputError(f"prompt must be a str, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InputError(f"prompt is not valid Unicode text ({err.reason} at character {err.start})") from None
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer; pass input_ids")
        if num_images and not self.is_multimodal:
            raise InputError(f"{num_images} image(s) given, but this is a text-only model")
        text = self.chat_text(f"{processors.IMAGE_MARKER}\n" * num_images + prompt)
        return np.asarray([self.processor.encode(self.tokenizer, text, image_tiles)], np.int32)

    def chat_text(self, content: str) -> str:
        """One user turn as the text `encode_chat` tokenizes: the checkpoint's chat template rendered
        with its special tokens (`special_tokens`), or `content` itself for a model without one."""
        from lookm_jax.convert.tokenizer import apply_chat_template

        template = self.manifest.get("chat_template")
        if not template:
            return content
        return apply_chat_template(template, [{"role": "user", "content": content}], special_tokens=self.special_tokens)

    def decode_text(self, tokens: Sequence[int]) -> str:
        """Token ids -> text, up to the first end-of-sequence token."""
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InputError(f"decode_text takes one row of integer token ids [L] (e.g. result.tokens[0]), "
                             f"got dtype {ids.dtype} and shape {ids.shape}")
        eos = set(self.text_config.eos_token_ids)
        kept = []
        for t in ids:
            if int(t) in eos:
                break
            kept.append(int(t))
        vocab = self.text_config.vocab_size
        outside = [t for t in kept if not 0 <= t < vocab]
        if outside:
            raise InputError(f"token ids must be in [0, {vocab}), got {outside[:5]}")
        return self.tokenizer.decode(kept, skip_special_tokens=True)

    def save(self, path: str) -> None:
        """Write a converted folder that `lookm_jax.load` reads back (atomic)."""
        from lookm_jax.convert.store import save_converted

        tokenizer_json = self.tokenizer.to_str() if self.tokenizer is not None else None
        params = {**jax.tree.map(np.asarray, {k: v for k, v in self.params.items() if k != "text"}),
                  "text": llama.stored_params(self.text_config, self.params["text"])}  # the stored layout
        save_converted(path, params, self.manifest, tokenizer_json)
