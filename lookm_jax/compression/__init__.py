"""The compression core: scoring (eq. 4), selection (eq. 5-8 and the modality quota), merging (eq. 9-12),
`compress_kv` over a layer's prompt cache, and one class per method under `methods/`.

It imports no model code: a method sees keys, values, attention statistics and an image mask, never a
model. `tests/test_layout.py` checks that.
"""
