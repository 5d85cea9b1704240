"""Hugging Face checkpoints, a lean transformer that runs attention plans, and a KV cache.

    >>> model = dspec.models.load_checkpoint("path/to/checkpoint")       # doctest: +SKIP
    >>> cache = model.new_cache(batch_size=1)
    >>> plan = model.plan([prompt_ids], cache)            # the model's own mask, after the cache
    >>> out = model(plan)                                 # logits [1, N, V], suffix_kv
    >>> cache.append(out.suffix_kv, counts=plan.lengths)  # commit the prompt
    >>> sm = dspec.masks.causal(4)                        # or a tree, SSD copies, ...
    >>> plan = AttentionPlan.from_offsets(drafts, sm.positions, sm.words, cache)
    >>> out = model(plan)                                 # verify; then commit what was accepted

Families: Llama / Qwen2 / Qwen3 causal LMs, LLaDA, Dream, SDAR, Fast-dLLM v2 (see
``dspec.models.config``).  transformers is not needed at runtime.
"""

from .config import ATTENTION_KINDS, FAMILIES, ModelConfig, detect_family, parse_config
from .kv_cache import KVCache, SuffixKV
from .loader import checkpoint_names, expected_shapes, load_checkpoint
from .plan import AttentionPlan
from .tokenizer import Tokenizer
from .transformer import Model, Output

__all__ = [
    "ATTENTION_KINDS",
    "AttentionPlan",
    "FAMILIES",
    "KVCache",
    "Model",
    "ModelConfig",
    "Output",
    "SuffixKV",
    "Tokenizer",
    "checkpoint_names",
    "detect_family",
    "expected_shapes",
    "load_checkpoint",
    "parse_config",
]
