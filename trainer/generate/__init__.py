"""Text generation: a sampler with a KV cache and continuous batching, and checkpoint samples.

``engine`` (``Engine``: the loop), ``scheduler`` (continuous batching), ``cache`` (``KVCache``),
``attention`` (``ftq_sampler``: the stock model's attention on the cache), ``sampling`` (logits to
tokens), ``stopping`` (eos, stop sequences), ``params`` (``SamplingParams``, ``Request``,
``Result``), ``chat`` (messages through the chat template), ``samples`` (the ``sample`` event's
greedy generations at checkpoints). See docs/sampler.md.
"""
