"""lookm-jax: LOOK-M KV-cache compression for LLaVA-style multimodal LLMs, in pure jit-compiled JAX."""

from lookm_jax.cache import KVCache
from lookm_jax.errors import InputError, PromptTooLongError
from lookm_jax.generate import DEFAULT_BUCKETS, LONG_BUCKETS
from lookm_jax.loading import load, load_default
from lookm_jax.model import GenerationResult, Model
from lookm_jax.sharding import make_mesh, shard_params
from lookm_jax import sweep  # sweep.generate_methods: many methods from one prefill
from lookm_jax.context import Answer, Context  # Model.prefill_context / Model.ask: compress once, ask many
from lookm_jax import chat  # chat.Conversation: turns rendered with the chat template on one context


# compression core
from lookm_jax.compression.scoring import attention_scores
from lookm_jax.compression.compress import compress_kv, CompressedKV
from lookm_jax.compression.methods import get_method, METHODS
