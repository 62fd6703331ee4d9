"""Environments for multi-turn rollouts: the contract (``base``), the registry and plugin paths
(``registry``), tool calls (``tools``), the guarded episode (``episode``), the config's ``env``
section to episodes (``setup``), and the built-ins (``running_sum``, ``lookup``, ``frozenlake``,
the ``python`` tool). docs/agents.md.
"""
