"""Plan-time: measured service profiles (:mod:`.profile`) and the latency and memory check
a config must pass before merge (:mod:`.check`).
"""
