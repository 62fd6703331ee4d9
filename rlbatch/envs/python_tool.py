"""The ``python`` tool: run the policy's code in the code sandbox and return what it printed.

``{"name": "python", "arguments": {"code": "print(6 * 7)"}}`` -> ``42``. Each call is one
sandbox execution (``rlbatch.sandbox.runner.Sandbox``) with the run's ``sandbox.isolation`` and
``sandbox.limits``: the isolation, the resource limits and the timeout of the code_sandbox role's
executions. Code that raises, times out or hits a limit is a failed call (``tool_error``): the
policy reads its output so far and the reason (the sandbox reports an exception's type, not its
traceback). ``env.step_timeout_s`` must leave room for ``sandbox.limits.timeout_s`` (validation
checks it), so a runaway execution is killed by the sandbox and reported, not abandoned.
"""

from __future__ import annotations

import threading

from rlbatch.config.schema import RLBatchConfig
from rlbatch.envs.base import Tool, ToolError


def python_tool(cfg: RLBatchConfig) -> Tool:
    """The tool for the run's config (reads ``sandbox``). The sandbox starts (and probes that a
    right program runs, as the code_sandbox role does) on the first call."""
    from rlbatch.sandbox.runner import Job, Sandbox

    limits, mode = cfg.sandbox.limits, cfg.sandbox.isolation
    lock = threading.Lock()
    box: list[Sandbox] = []

    def python(code: str) -> str:
        """Run ``code`` as a Python program; its stdout and stderr."""
        if not isinstance(code, str):
            raise ToolError(f"python: code must be text, got {type(code).__name__}")
        with lock:
            if not box:
                box.append(Sandbox(limits, mode, workers=1))
        outcome = box[0].run(Job(code, ()))
        if outcome.reason != "ok":
            raise ToolError(f"{outcome.output}{outcome.reason}")
        return outcome.output

    return python
