"""The batching policy: the pure micro-batcher (:mod:`.batcher`), clock injected, no I/O."""
