"""Decoder-LM recipes on the plugin: ``decoder/`` holds what every model family shares, ``models/<family>/`` one
family each (registered in ``families.py``), and ``train.py`` / ``convert.py`` / ``generate.py`` serve them all.
The recipe's former module names (``recipes.llama2.*``) still import, as aliases (``legacy.py``)."""

from recipes import legacy

legacy.install()
