"""The ``polykv-agents`` command line: ``demo``, ``ppl`` (:mod:`~polykv_agents.cli.main`) and ``bench``
(:mod:`~polykv_agents.cli.bench`)."""
