"""The pinned model: checkpoints and built-in models (:mod:`.zoo`), payload decoding
(:mod:`.payloads`), the runner (:mod:`.runner`), the reference workloads (:mod:`.workloads`).
"""
