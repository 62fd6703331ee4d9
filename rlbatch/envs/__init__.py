"""Environments for multi-turn rollouts: the contract (``base``), the registry and plugin paths
(``registry``), tool calls (``tools``), the guarded episode (``episode``), the config's ``env``
section to episodes (``setup``), the rollout of many trajectories (``rollout``), trajectories as the
generate phase's samples (``trajectories``) and their reward (``scoring``), and the built-ins
(``running_sum``, ``lookup``, ``frozenlake``, the ``python`` tool). docs/agents.md.
"""
