"""Rule-based rewards: ``fn(completion: str, answer: str) -> float``, and a loader by name.

A completion is the decoded generated text *with* special tokens kept, e.g. ``"7<eos><pad>"``:
only then can a reward tell "stopped after 7" from "ran out of tokens after 7". Everything
from the first stop marker on is ignored.

``data.reward_fn`` is checked twice: its signature when it is loaded (the launcher loads it
before anything starts), and each value it returns when the reward role scores. A reward that
raises or is not a finite number ends the run with a ``RewardError`` naming the function, the
value and the sample, rather than training on a reward that was never computed: a NaN reward
would turn every advantage of its group into NaN.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlbatch.config.schema import DataConfig, RLBatchConfig

RewardFn = Callable[[str, str], float]

STOP_MARKERS: tuple[str, ...] = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>")
_NUMBER = re.compile(r"-?\d+")
_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


def split_at_stop(completion: str, stops: Sequence[str] = STOP_MARKERS) -> tuple[str, bool]:
    """Text before the earliest stop marker, and whether a stop marker was found at all."""
    cut = len(completion)
    for stop in stops:
        at = completion.find(stop)
        if 0 <= at < cut:
            cut = at
    return completion[:cut], cut < len(completion)


def extract_answer(completion: str) -> str:
    """The answer a completion gives: its text before the first stop marker, stripped."""
    return split_at_stop(completion)[0].strip()


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the text before the stop is exactly the answer (ignoring outer whitespace).

    Strict on purpose: "7" followed by more tokens is wrong, so the policy must also learn
    to stop. Running out of tokens right after the answer still counts.
    """
    return 1.0 if extract_answer(completion) == answer.strip() else 0.0


def leading_number_match(completion: str, answer: str) -> float:
    """1.0 when the first number the completion starts with equals the answer numerically.

    Lenient: "7=3" and "7<eos>" both answer 7; "x7" answers nothing.
    """
    match = _LEADING_NUMBER.match(extract_answer(completion))
    if match is None:
        return 0.0
    try:
        return 1.0 if int(match.group(1)) == int(answer.strip()) else 0.0
    except ValueError:
        return 0.0


def answer_repeated(completion: str, answer: str, length: int = 64) -> float:
    """The share of the first ``length`` characters, read as answer-sized chunks, that are the answer.

    A long-response rule: "7777…" up to ``length`` characters scores 1.0, "7<eos>" scores 1/64,
    a random string about 1/vocabulary. Every chunk carries its own part of the reward, so each
    generated token gets a learning signal, and stopping early only loses reward: responses stay
    ``length`` long as the policy learns (the long-response workload of tools/bench/vs_trl.py).
    """
    want = answer.strip()
    if not want:
        return 0.0
    text = extract_answer(completion)[:length]
    width = len(want)
    hits = sum(text[i : i + width] == want for i in range(0, len(text) - width + 1, width))
    return hits / (length // width)


def format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion is a bare integer followed by a stop marker; ignores ``answer``."""
    text, stopped = split_at_stop(completion)
    return 1.0 if stopped and _NUMBER.fullmatch(text.strip()) else 0.0


def exact_match_with_format(completion: str, answer: str) -> float:
    """Exact match, plus a 0.1 bonus for a well-formed but wrong answer (max 1.0).

    The bonus gives the random policy some signal before it hits any right answer; it stays
    small so a mean reward of 0.8 still means most answers are right.
    """
    if exact_match(completion, answer):
        return 1.0
    return 0.1 * format_reward(completion, answer)


def reward_fn_problem(path: Any, field: str) -> str | None:
    """Why ``path`` cannot serve as the reward function ``field`` names (``load_reward_fn``'s reason,
    or what importing its module raised), or None."""
    try:
        load_reward_fn(path)
    except ValueError as e:
        return f"{field}: {e}"
    except Exception as e:  # the user's module failed while importing
        return f"{field}: importing {path!r} failed: {type(e).__name__}: {e}"[:400]
    return None


def load_reward_fn(path: str) -> RewardFn:
    """Import a reward function named ``"package.module:function"`` or ``"package.module.function"``.

    Only importlib and getattr are used, never eval. Any failure (bad syntax, missing module,
    missing attribute, not callable) raises ``ValueError`` naming ``path`` and the reason.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"reward function path must be a non-empty string, got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr or ":" in attr:
        raise ValueError(
            f"reward function path {path!r} must look like 'package.module:function' or 'package.module.function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {path!r}: cannot import module {module_name!r}: {exc}") from exc
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"reward function {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"reward function {path!r} is a {type(obj).__name__}, not a callable")
    if (problem := _signature_problem(obj)) is not None:
        raise ValueError(f"reward function {path!r} {problem}")
    return obj


def _signature_problem(fn: Callable[..., Any]) -> str | None:
    """Why ``fn`` cannot be called as ``fn(completion, answer)`` to give a number, or None.

    Read from the signature only: the user's code does not run before the reward role scores.
    """
    if isinstance(fn, type):
        return (f"is the class {fn.__name__}: calling it makes an instance, not a reward; name a function "
                f"(completion, answer) -> float, or a module-level instance of the class")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        return "is an async function: it returns an awaitable, not a reward; make it a plain function"
    if inspect.isgeneratorfunction(fn):
        return "is a generator function: it returns a generator, not a reward; return the number"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: judged by what it returns
        return None
    try:
        sig.bind("completion", "answer")
    except TypeError as e:
        return f"has the signature {sig}, but rewards are called as fn(completion, answer) ({e})"
    return None


class RewardError(RuntimeError):
    """``data.reward_fn`` (or the ``data.reward_fns`` route, ``field``) raised, or returned what is not a
    finite number, for one response.

    ``index`` is the response's position in the list scored; the reward role's runtime replaces
    it with the sample's id (``for_sample``).
    """

    def __init__(self, fn: str, what: str, index: int, completion: str, answer: str, sample: int | None = None,
                 field: str = "data.reward_fn") -> None:
        self.fn, self.what, self.index, self.completion, self.answer = fn, what, index, completion, answer
        self.sample, self.field = sample, field
        where = f"sample {sample}" if sample is not None else f"response {index} of the batch scored"
        # One line: the rank's console report shows the last line of the error only.
        super().__init__(f"{field} {fn!r} on {where} (answer {_excerpt(answer)}, completion "
                         f"{_excerpt(completion)}) {what}")

    def for_sample(self, sample: int) -> RewardError:
        """The same error, naming the run's sample id instead of the position in the batch."""
        return RewardError(self.fn, self.what, self.index, self.completion, self.answer, sample, self.field)


def _excerpt(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _shown(value: object, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # the user's __repr__ failed: the type still says what came back
        return f"<unprintable {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def reward_value(value: Any) -> float | None:
    """``value`` as a reward: a finite real number (bool, int, float, numpy or 0-d tensor scalar), else None.

    A string is not a number even when it spells one: ``float("1")`` would hide a reward function
    that returns the wrong thing.
    """
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(type(value), "__float__")):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # a tensor of several elements, 10**400
        return None
    return out if math.isfinite(out) else None


def reward_routes(data_cfg: DataConfig) -> tuple[str, dict[str, str]]:
    """``data.reward_fn`` (the default) and ``data.reward_fns`` (data_source -> function), stripped."""
    default = str(data_cfg.reward_fn).strip()
    routes = getattr(data_cfg, "reward_fns", None) or {}
    return default, {str(k): str(v).strip() for k, v in dict(routes).items()}


def rule_scorer(cfg: RLBatchConfig) -> Callable[..., tuple[list[float], dict[str, int]]]:
    """The reward role's scorer: on each (completion, answer), the reward function of the sample's
    data source (``sources``, one per completion: ``data.reward_fns``; ``data.reward_fn`` for a source
    it does not name and for samples without one); a RewardError on the first response it fails on."""
    default, routes = reward_routes(cfg.data)
    fns = {name: load_reward_fn(name) for name in dict.fromkeys([default, *routes.values()])}

    def score(completions: list[str], answers: list[str], sources: list[str] | None = None,
              ) -> tuple[list[float], dict[str, int]]:
        rewards = []
        for i, (c, a, source) in enumerate(zip(completions, answers, sources or [""] * len(answers), strict=True)):
            name = routes.get(source, default)
            field = f"data.reward_fns[{source!r}]" if source in routes else "data.reward_fn"
            try:
                value = fns[name](c, a)
            except Exception as e:
                said = " ".join(str(e).split())  # one line, whatever the message holds
                raise RewardError(name, f"raised {type(e).__name__}: {said}"[:300], i, c, a, field=field) from e
            reward = reward_value(value)
            if reward is None:
                raise RewardError(name, f"returned {_shown(value)} ({type(value).__name__}), not a finite number",
                                  i, c, a, field=field)
            rewards.append(reward)
        return rewards, {}

    return score
