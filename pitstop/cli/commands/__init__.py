"""The ``pitstop`` commands that look at and tidy a checkpoint directory, one module each:
``ls``, ``inspect``, ``verify``, ``gc`` (``run``, ``diff``, ``demo``, ``export``/``import`` are
modules of :mod:`pitstop.cli`). Each has ``add_parser(sub)`` and its ``cmd_<name>(args)``."""
