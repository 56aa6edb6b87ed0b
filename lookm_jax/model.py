"""The user-facing model: config + params + tokenizer, with `logits`, `generate` and `run`.

Compiled programs are cached per static signature (bucket, batch, image count, method, budgets,
max_new_tokens, sampling): a new prompt length inside a bucket reuses them. `compile_count` says
how many were built, which is what the no-recompilation tests check.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lookm_jax import generate as gen, sharding
from lookm_jax.models import llama, llava
from lookm_jax.models.config import LlamaConfig, LlavaConfig


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_logits(cfg: LlavaConfig | LlamaConfig, params: dict, input_ids: jax.Array, valid: jax.Array,
                   pixel_values: jax.Array | None) -> jax.Array:
    """[B, L] ids -> [B, L, V] fp32 logits, no cache. Static: cfg; L is the static bucket length."""
    x, _ = llava.embed(cfg, params, input_ids, pixel_values)
    h = llama.forward(llava.text_config(cfg), params["text"], x, valid)
    return llama.lm_logits(params["text"], h)


@jax.jit
def kept_by_modality(positions: jax.Array, is_image: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Prompt slots kept in a cache, mean over layers and KV heads.

    positions [N, B, Hkv, S] (-1 = empty), is_image [B, L] -> (image [B], text [B]) float32.
    """
    kept = positions >= 0
    modality = jnp.broadcast_to(is_image[None, :, None, :], positions.shape[:3] + is_image.shape[-1:])
    image = jnp.take_along_axis(modality, jnp.maximum(positions, 0), axis=-1) & kept
    return image.sum(-1).mean(axis=(0, 2)), (kept & ~image).sum(-1).mean(axis=(0, 2))


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] int32; after EOS filled with the EOS id
    lengths: np.ndarray  # [B] tokens generated, EOS included
    prompt_lengths: np.ndarray  # [B] real prompt tokens
    image_tokens: np.ndarray  # [B] of which image placeholders
    kept_image_tokens: np.ndarray  # [B] image tokens the cache kept, mean over layers and KV heads
    kept_text_tokens: np.ndarray  # [B] text tokens the cache kept, likewise
    bucket: int
    cache_bytes: int  # K/V bytes of the decode cache (kept prompt slots + max_new_tokens)
    full_cache_bytes: int  # the same for an uncompressed cache of this bucket
    compile_seconds: float  # 0 when the programs were already compiled
    prefill_seconds: float  # prefill + compression (+ first token)
    decode_seconds: float  # the decode loop

    @property
    def decode_ms_per_token(self) -> float:
        steps = max(int(self.lengths.max()) - 1, 1)  # the first token comes from prefill
        return 1e3 * self.decode_seconds / steps


@dataclasses.dataclass
class Model:
    config: LlavaConfig | LlamaConfig
    params: dict  # jax arrays, see models/llama.py, clip.py, llava.py for the layout
    manifest: dict[str, Any]  # hf_config, chat_template, image_processor, notes (what `save` writes)
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
    def dtype(self):
        return self.params["text"]["embed"].dtype

    @property
    def compile_count(self) -> int:
        return len(self._compiled)

    def astype(self, dtype) -> "Model":
        """The same model with every parameter cast (e.g. jnp.bfloat16)."""
        params = jax.tree.map(lambda a: a.astype(dtype), self.params)
        return dataclasses.replace(self, params=params, _compiled={})

    def shard(self, mesh: jax.sharding.Mesh) -> "Model":
        """The same model laid out on a (data, model) mesh (`lookm_jax.sharding.make_mesh`): params
        tensor-parallel over "model", and every call shards its rows over "data" (the batch must
        divide evenly) and the KV cache's heads over "model"."""
        sharding.check_mesh(mesh, self.text_config.num_kv_heads)
        return dataclasses.replace(self, params=sharding.shard_params(self.params, mesh), mesh=mesh, _compiled={})

    def _rows(self, *arrays: np.ndarray) -> list[jax.Array]:
        """[B, ...] host arrays on the device, or split over the mesh's "data" axis."""
        return [jnp.asarray(a) for a in arrays] if self.mesh is None else sharding.place_rows(self.mesh, *arrays)

    # ---- input checks -------------------------------------------------------------------------
    def _pixel_values(self, packed_ids: np.ndarray, valid: np.ndarray, pixel_values) -> jax.Array | None:
        n_placeholders = int(((packed_ids == self.config.image_token_id) & valid).sum()) if self.is_multimodal else 0
        if pixel_values is None:
            if n_placeholders:
                raise ValueError(f"prompt has {n_placeholders} image placeholder tokens but no pixel_values")
            return None
        if not self.is_multimodal:
            raise ValueError("pixel_values given, but this is a text-only model")
        pixel_values = np.asarray(pixel_values)
        expected = self.config.pixel_shape
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != expected:
            raise ValueError(f"pixel_values must be [num_images, {', '.join(map(str, expected))}], "
                             f"got {pixel_values.shape}")
        n_images = pixel_values.shape[0]
        if n_placeholders != n_images * self.config.image_seq_length:
            raise ValueError(f"{n_images} image(s) need {n_images * self.config.image_seq_length} placeholder "
                             f"tokens ({self.config.image_seq_length} each), the prompt has {n_placeholders}")
        return jnp.asarray(pixel_values, self.dtype)

    # ---- public API ---------------------------------------------------------------------------
    def logits(self, input_ids, pixel_values=None, attention_mask=None) -> np.ndarray:
        """HF-style forward: [B, L] ids -> [B, L, V] float32 logits (positions 0..L-1, mask on keys)."""
        ids = np.asarray(input_ids, np.int32)
        valid = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
        length = ids.shape[1]
        bucket = gen.bucket_length(length, self.buckets)
        pad = ((0, 0), (0, bucket - length))
        pixels = self._pixel_values(ids, valid, pixel_values)
        out = forward_logits(self.config, self.params, *self._rows(np.pad(ids, pad), np.pad(valid, pad)), pixels)
        return np.asarray(out[:, :length])

    def generate(self, input_ids, pixel_values=None, attention_mask=None, max_new_tokens: int = 32,
                 **kwargs) -> np.ndarray:
        """-> new tokens [B, max_new_tokens] int32 (greedy by default). kwargs as for `run`."""
        return self.run(input_ids, pixel_values, attention_mask, max_new_tokens, **kwargs).tokens

    def run(self, input_ids, pixel_values=None, attention_mask=None, max_new_tokens: int = 32, *,
            method=None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> GenerationResult:
        """Generate with timings and cache sizes. `method`: a compression method object (see
        `lookm_jax.get_method`) or None for the full cache. Prompts may be left- or right-padded."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if method is None:
            from lookm_jax.methods import get_method
            method = get_method("full")
        sampling = gen.Sampling(temperature, top_p)
        ids, valid = gen.pack_prompts(input_ids, attention_mask, self.buckets)
        pixels = self._pixel_values(ids, valid, pixel_values)
        key = jax.random.key(seed)
        args = (self.config, self.params, *self._rows(ids, valid), pixels, key)
        signature = (ids.shape, None if pixels is None else pixels.shape, method, max_new_tokens, sampling)
        compile_seconds = 0.0
        if signature not in self._compiled:
            start = time.perf_counter()
            with jax.set_mesh(self.mesh):  # None: no mesh
                prefill = gen.prefill.lower(*args, method=method, max_new_tokens=max_new_tokens,
                                            sampling=sampling).compile()
            first, cache, _ = prefill.out_info  # ShapeDtypeStructs with the compiled shardings
            decode = gen.decode.lower(self.text_config, self.params["text"], first, cache, key,
                                      max_new_tokens=max_new_tokens, sampling=sampling,
                                      eos_ids=self.text_config.eos_token_ids).compile()
            self._compiled[signature] = (prefill, decode)
            compile_seconds = time.perf_counter() - start
        prefill, decode = self._compiled[signature]
        dynamic = args[1:]
        start = time.perf_counter()
        first, cache, is_image = jax.block_until_ready(prefill(*dynamic))
        prefill_seconds = time.perf_counter() - start
        cache_bytes = cache.nbytes
        kept_image, kept_text = kept_by_modality(cache.positions, is_image)  # before decode donates the cache
        start = time.perf_counter()
        tokens, lengths, _ = jax.block_until_ready(decode(self.params["text"], first, cache, key))
        decode_seconds = time.perf_counter() - start
        cfg = self.text_config
        full_bytes = (2 * cfg.num_layers * ids.shape[0] * cfg.num_kv_heads * (ids.shape[1] + max_new_tokens)
                      * cfg.head_dim * jnp.dtype(self.dtype).itemsize)
        return GenerationResult(
            tokens=np.asarray(tokens), lengths=np.asarray(lengths), prompt_lengths=valid.sum(1),
            image_tokens=(np.asarray(is_image) & valid).sum(1), kept_image_tokens=np.asarray(kept_image),
            kept_text_tokens=np.asarray(kept_text), bucket=ids.shape[1], cache_bytes=cache_bytes,
            full_cache_bytes=full_bytes, compile_seconds=compile_seconds, prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds)

    def generate_methods(self, input_ids, pixel_values=None, attention_mask=None, max_new_tokens: int = 32, *,
                         methods: Sequence, max_decode_rows: int = 16) -> list[np.ndarray]:
        """Greedy new tokens [B, max_new_tokens] for each of `methods`, from ONE prefill.

        The same tokens as `generate(..., method=m)` for each m (the prompt's hidden states do not
        depend on the method), at the cost of one prefill: `generate.prefill_states` keeps the
        uncompressed per-layer K/V and statistics, `generate.compress_prefilled` builds each
        method's cache, and methods of equal capacity decode together, up to `max_decode_rows`
        rows per `generate.decode` call (at least one method's B rows).
        """
        from lookm_jax.scoring import STATISTICS

        if max_new_tokens < 1 or not methods:
            raise ValueError(f"need max_new_tokens >= 1 and at least one method, got {max_new_tokens}, {methods}")
        if self.mesh is not None:
            raise ValueError("generate_methods runs on one device; call it on the unsharded model")
        ids, valid = gen.pack_prompts(input_ids, attention_mask, self.buckets)
        pixels = self._pixel_values(ids, valid, pixel_values)
        batch, bucket = ids.shape
        key = jax.random.key(0)
        sampling = gen.Sampling()
        prefilled = gen.prefill_states(
            self.config, self.params, jnp.asarray(ids), jnp.asarray(valid), pixels, key,
            statistics=tuple(s for s in STATISTICS if any(s in m.statistics for m in methods)),
            window=max(1, *(gen.query_window(m, bucket) for m in methods)), sampling=sampling)
        by_capacity: dict[int, list[int]] = {}
        for i, m in enumerate(methods):
            by_capacity.setdefault(m.capacity(bucket), []).append(i)
        per_call = max(1, max_decode_rows // batch)
        out: list[np.ndarray | None] = [None] * len(methods)
        for indices in by_capacity.values():
            for start in range(0, len(indices), per_call):
                chunk = indices[start:start + per_call]
                caches = [gen.compress_prefilled(prefilled, method=methods[i], max_new_tokens=max_new_tokens)
                          for i in chunk]
                first = jnp.tile(prefilled.first, len(chunk))
                tokens, _, _ = gen.decode(self.text_config, self.params["text"], first, gen.concat_caches(caches),
                                          key, max_new_tokens=max_new_tokens, sampling=sampling,
                                          eos_ids=self.text_config.eos_token_ids)
                for i, rows in zip(chunk, np.split(np.asarray(tokens), len(chunk))):
                    out[i] = rows
        return out

    # ---- inputs -------------------------------------------------------------------------------
    def preprocess_images(self, images: Sequence) -> tuple[np.ndarray, list[int] | None]:
        """Image files or PIL images -> (pixel_values [units, C, H, W], tiles per image or None).

        Uses the checkpoint's own preprocessor settings (the CLIP defaults at the tower's image size
        when it has none): the CLIP processor (with LLaVA's pad-to-square when configured) or, for tiling architectures (InternVL), dynamic tiles; pass the
        tile counts to `encode_chat(..., image_tiles=...)`.
        """
        from PIL import Image

        from lookm_jax.models.internvl import InternVLConfig

        if not self.is_multimodal:
            raise ValueError("images given, but this is a text-only model")
        pictures = [Image.open(i) if isinstance(i, (str, os.PathLike)) else i for i in images]
        settings = self.manifest.get("image_processor") or {}
        if isinstance(self.config, InternVLConfig):
            from lookm_jax.models.internvl_processing import InternVLImageProcessorConfig, preprocess_tiles

            return preprocess_tiles(pictures, InternVLImageProcessorConfig.from_hf_dict(settings))
        from lookm_jax.models.image_processing import CLIPImageProcessorConfig, preprocess_images

        if not settings:  # no preprocessor_config.json: the CLIP processor at the tower's own size
            _, height, width = self.config.pixel_shape
            settings = {"size": {"shortest_edge": height}, "crop_size": {"height": height, "width": width}}
        return preprocess_images(pictures, CLIPImageProcessorConfig.from_hf_dict(settings)), None

    # ---- text ---------------------------------------------------------------------------------
    def encode_chat(self, prompt: str, num_images: int = 0, image_tiles: Sequence[int] | None = None) -> np.ndarray:
        """A user turn rendered with the model's chat template -> ids [1, L].

        `num_images` images go before the text; "<image>" markers inside `prompt` place further
        images inline (MileBench-style interleaving). Every image expands to its placeholder tokens.
        Tiling architectures (InternVL) need `image_tiles`: each image's tile count, in order, from
        its preprocessing (`models.internvl_processing.preprocess_tiles`).
        """
        from lookm_jax.convert.tokenizer import apply_chat_template

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass input_ids")
        if num_images and not self.is_multimodal:
            raise ValueError("images given, but this is a text-only model")
        content = "<image>\n" * num_images + prompt
        template = self.manifest.get("chat_template")
        text = apply_chat_template(template, [{"role": "user", "content": content}]) if template else content
        if hasattr(self.config, "expand_image_markers"):  # tiling: <img> + tiles * T placeholders + </img>
            text = self.config.expand_image_markers(text, self.tokenizer.id_to_token(self.config.image_token_id),
                                                    image_tiles or ())
            return np.asarray([self.tokenizer.encode(text, add_special_tokens=False).ids], np.int32)
        if image_tiles is not None:
            raise ValueError("image_tiles is only for tiling architectures (InternVL)")
        if self.is_multimodal and self.config.image_token_id < 0:
            # Original LLaVA layout (id -200): no "<image>" token; each piece between markers is encoded
            # on its own and the placeholders go between them, as LLaVA's tokenizer_image_token does.
            pieces = [self.tokenizer.encode(piece, add_special_tokens=False).ids for piece in text.split("<image>")]
            placeholders = [self.config.image_token_id] * self.config.image_seq_length
            return np.asarray([pieces[0] + [t for piece in pieces[1:] for t in placeholders + piece]], np.int32)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.is_multimodal:
            image_id = self.config.image_token_id
            ids = [t for i in ids for t in ([i] * self.config.image_seq_length if i == image_id else [i])]
        return np.asarray([ids], np.int32)

    def decode_text(self, tokens: Sequence[int]) -> str:
        eos = set(self.text_config.eos_token_ids)
        kept = []
        for t in tokens:
            if int(t) in eos:
                break
            kept.append(int(t))
        return self.tokenizer.decode(kept, skip_special_tokens=True)

    def save(self, path: str) -> None:
        """Write a converted folder that `lookm_jax.load` reads back (atomic)."""
        from lookm_jax.convert.store import save_converted

        tokenizer_json = self.tokenizer.to_str() if self.tokenizer is not None else None
        save_converted(path, jax.tree.map(np.asarray, self.params), self.manifest, tokenizer_json)
