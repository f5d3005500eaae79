"""The scoring loop: the scorer's threads (:mod:`.scorer`), what its stages hand each other
(:mod:`.stages`), its limits and stats (:mod:`.stats`), and ``--workers N`` processes
(:mod:`.workers`, :mod:`.pipes`). Given its ports; imports no adapter.
"""
