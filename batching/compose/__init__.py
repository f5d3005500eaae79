"""The composition root: the adapters a config names (:mod:`.build`), one scoring run's
life (:mod:`.run`) and its record (:mod:`.record`), the demo (:mod:`.demo`).
"""
