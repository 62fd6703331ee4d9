"""Prompt data: synthetic tasks with known answers and a tokenizer built in code.

The tokenizer lives in ``rlbatch.data.tokenizer`` and is not imported here, so importing the
synthetic tasks does not pull in ``transformers``.
"""

from rlbatch.data.synthetic import PromptStream, Sample, arithmetic_problems

__all__ = ["PromptStream", "Sample", "arithmetic_problems"]
