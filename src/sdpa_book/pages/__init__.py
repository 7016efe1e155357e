"""Helpers of single pages of the book (or of one part): each module serves the pages named
here, and the rest of ``sdpa_book`` (glue, tables, timing, the figure style, the diagrams, the
widgets) is what many pages share. Its modules, and the pages each serves:

block_grid
    *Programmable attention* (``book/modern/programmable-attention.md``):
    :func:`~sdpa_book.pages.block_grid.block_kinds` (full, partial and empty tiles of a block
    mask) and :func:`~sdpa_book.pages.block_grid.block_grid` (one panel of them).
sparse
    *Sparse attention* (``book/modern/sparse-attention.md``):
    :func:`~sdpa_book.pages.sparse.topic_sequence` (queries and keys with a known structure) and
    :func:`~sdpa_book.pages.sparse.sparse_entries` (the entries block-sparse attention computes).
lm
    *Training a language model* (``book/lm/training.md``) trains the book's language model;
    the pages of Part VIII (``book/measured/``: attention sinks, QK-norm, latent attention,
    quantised KV caches) study it through :func:`~sdpa_book.pages.lm.trained_lm`, which trains it
    once per build.
kv_quant
    *Quantised KV caches* (``book/measured/quantised-kv-cache.md``):
    :func:`~sdpa_book.pages.kv_quant.quantise` and :func:`~sdpa_book.pages.kv_quant.dequantise`,
    integer keys and values with per-channel or per-token scales.
serving
    Part IX, *Serving the model* (``book/serving/``): arrival traces and fixed batches
    (:func:`~sdpa_book.pages.serving.arrival_trace`,
    :func:`~sdpa_book.pages.serving.static_batching`), the timeline of an engine's steps
    (:func:`~sdpa_book.pages.serving.serve_trace`) and a model of SGLang's radix-tree cache
    (:class:`~sdpa_book.pages.serving.RadixCache`).
layer_patterns
    *Layer patterns and what they cost* (``book/measured/layer-patterns.md``), the RoPE page's
    scaling types and the latent-attention page's serving section: caches by layer kind
    (:data:`~sdpa_book.pages.layer_patterns.MODELS`,
    :func:`~sdpa_book.pages.layer_patterns.kv_bytes_per_token`), RoPE frequencies of the
    ``llama3``, ``dynamic`` and ``longrope`` types, and MLA's naive and absorbed FLOPs.
stability
    *QK-norm and soft-capping* (``book/measured/qk-norm.md``) and *Differential attention*
    (``book/measured/differential-attention.md``): what the pages record while a model trains
    (attention logits and entropies) and Kimi K2's QK-clip as a training callback
    (``QKClip``).
indexer
    *Choosing the keys* (``book/modern/sparse-selection.md``): DeepSeek's lightning indexer as a
    top-k mask and its KL warm-up on the trained model, and compressed sparse attention from
    two ``flex_attention`` branches merged by their log-sum-exps.
low_precision
    *Attention in low precision* (``book/measured/low-precision.md``): rounding to FP8, bf16
    and fp16 exactly, scales per tensor, head or block, and attention with quantised products.
live_model
    *The model, live* (``book/lm/live-model.md``): the trained model's weights and the
    grammar's next words exported for the page's JavaScript forward pass.
"""
