"""One RL step's work: how many sequences, how long, split how.

Everything here comes from ``cfg.algo`` and ``cfg.data`` plus the few numbers a config does not
hold (prompt length of a file dataset, the policy's mean response length), which the CLI takes
as options and a run's metrics supply when reporting on it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlbatch.config.schema import RLBatchConfig
from rlbatch.phases import reference_is_actor_base

SYNTHETIC_PROMPT_LEN = 5
"""The built-in task's prompts: '<bos>a+b=' is 5 tokens (rlbatch/data/synthetic.py, tokenizer.py)."""
DEFAULT_OBSERVATION_LEN = 16.0
"""Tokens of an environment's observation between two turns, when not given (``--observation-tokens``)."""
DEFAULT_PROMPT_LEN = 512
"""Assumed prompt length for file datasets when --prompt-len is not given."""
DEFAULT_RESPONSE_MEAN_FRAC = 0.6
"""Assumed mean response length as a fraction of max_new_tokens when --response-mean is not given:
RL responses run long-tailed, with the longest at the cap and the mean well below it."""
DEFAULT_IMAGE_SIDE = 448
"""Assumed side in pixels of a vision-language prompt's one image when the data set does not say
(a file dataset): 256 image tokens at Qwen2-VL's 28-pixel merged patches."""
DEFAULT_ZERO_VARIANCE_FRAC = 0.5
"""Assumed share of generated groups whose rewards are all equal, for dynamic sampling's extra
generation rounds, when --zero-variance-frac is not given (a run's ``sampling/zero_variance_frac``
measures it)."""


def expected_rounds(groups: int, zero_variance_frac: float, cap: int) -> float:
    """Dynamic sampling's expected generate+score rounds per step.

    Each round generates ``groups`` groups (prompts_per_step); each is useful (rewards not all equal)
    with probability ``q = 1 - zero_variance_frac``, independently. Round k+1 (k >= 1) runs when
    the k rounds before it left fewer than ``groups`` useful groups, and at most ``cap`` rounds run:

        E[rounds] = sum_{k=0}^{cap-1} P(Binomial(k * groups, q) < groups)

    (the k=0 term is 1: the first round always runs). With many groups this approaches
    min(cap, ceil(1 / q)); f = 0 gives 1 round, f = 1 the cap."""
    if groups < 1 or cap < 1:
        raise ValueError(f"dynamic sampling needs groups >= 1 and cap >= 1, got groups={groups}, cap={cap}")
    if not 0.0 <= zero_variance_frac <= 1.0:
        raise ValueError(f"the zero-variance group fraction must be in [0, 1], got {zero_variance_frac}")
    q = 1.0 - zero_variance_frac
    return sum(_binomial_cdf_below(k * groups, q, groups) for k in range(cap))


def _binomial_cdf_below(n: int, q: float, m: int) -> float:
    """P(Binomial(n, q) < m), summed in log space (n may be thousands)."""
    if m <= 0:
        return 0.0
    if q <= 0.0 or n < m:
        return 1.0
    if q >= 1.0:
        return 0.0
    lq, lp = math.log(q), math.log1p(-q)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lq + (n - i) * lp)
                        for i in range(m)))


@dataclass(frozen=True)
class Workload:
    """The batch of one step."""

    sequences: int
    """prompts_per_step * samples_per_prompt."""
    prompt_len: float
    """Mean prompt tokens."""
    response_mean: float
    """Mean generated tokens per sequence."""
    response_max: int
    """Longest response: the number of decode steps of the batch (the long tail)."""
    max_new_tokens: int
    samples_per_prompt: int = 1
    """Sequences sharing one prompt (GRPO's group): engines that run a repeated prompt once do that
    much less prompt work."""
    mini_batches: int = 1
    epochs: int = 1
    grad_accum: int = 1
    kl: bool = True
    """The reference's log-probs are needed (kl_coef > 0): the reference role's, or with
    ``model.lora`` the trained policy's base model's (``lora_rank``)."""
    critic: bool = False
    """PPO: the critic computes values and trains."""
    kl_in_reward: bool = False
    """The KL is subtracted from the reward: old log-probs are needed even with one update."""
    entropy: bool = False
    """The loss needs the entropy of the full distribution (entropy_coef > 0)."""
    recompute: bool = False
    """Activation checkpointing in training."""
    generation_rounds: float = 1.0
    """Expected generate+score rounds per step: 1, or with DAPO's dynamic sampling
    ``expected_rounds`` (the later phases work on the one kept batch)."""
    zero_variance_frac: float | None = None
    """The zero-variance group fraction the rounds were derived from (None without dynamic sampling)."""
    max_staleness: int = 0
    """Asynchronous training (``algo.max_staleness``): a later step's generation runs beside this
    step's other phases when actor_infer has ranks of its own."""
    partial_rollouts: bool = False
    """``algo.partial_rollouts`` (with in-flight updates): a step's batch is the first groups to
    finish, the longest samples carried into later steps (``rlbatch.plan.inflight``)."""
    prompt_len_assumed: bool = False
    response_assumed: bool = False
    lora_rank: int = 0
    """``model.lora.rank``: the trained policy learns adapters of this rank (0: every weight)."""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """``model.lora.target_modules``."""
    lora_sync: str = "auto"
    """``model.lora.sync``: what a weight sync moves with adapters (``rlbatch.models.lora.sync_form``)."""
    turns: float = 1.0
    """Mean policy turns per trajectory (``env.name``: a multi-turn rollout); 1: one response. The
    response fields then describe the whole trajectory the trainer reads (turns and observations);
    generation runs turn by turn (``turn_workloads``)."""
    turn_response_mean: float = 0.0
    """Mean generated tokens of one turn (a multi-turn rollout)."""
    observation_len: float = 0.0
    """Mean tokens of an observation between two turns."""
    env_step_s: float = 0.0
    """Seconds an environment takes per step (and its tool calls), on each trajectory's critical path."""
    env_workers: int = 0
    """The env role's processes (``roles.env.world_size``): each trajectory's start and steps are
    round trips to one of them; 0: envs run on the inference ranks' threads."""
    turns_assumed: bool = False
    image_tokens: float = 0.0
    """Vision-language model: image tokens of a prompt (included in ``prompt_len``)."""
    image_patches: float = 0.0
    """Patches the vision tower attends over per prompt (image tokens x merge^2)."""
    vision_flops: float = 0.0
    """Forward FLOPs of the vision tower on one prompt's images (it runs per sequence in a pass)."""
    train_vision: bool = False
    """``model.train_vision``: the tower gets gradients and optimizer state (else frozen)."""
    images_assumed: bool = False
    """The image size is ``DEFAULT_IMAGE_SIDE``'s, not the data set's."""

    @property
    def seq_len(self) -> float:
        """Padded length of a training sequence: prompt plus the longest response."""
        return self.prompt_len + self.response_max

    @property
    def generated_tokens(self) -> float:
        if self.turns > 1:
            return self.sequences * self.turns * self.turn_response_mean
        return self.sequences * self.response_mean

    def turn_workloads(self) -> list[tuple[Workload, float]]:
        """A multi-turn rollout's generation as one generation per turn, with its weight (the last
        turn's share of a fractional mean): turn k's prompt is the task's plus the k turns and
        observations before it; it generates ``turn_response_mean`` tokens up to ``max_new_tokens``."""
        if self.turns <= 1:
            return [(self, 1.0)]
        step = self.turn_response_mean + self.observation_len
        one = replace(self, turns=1.0, response_mean=max(1.0, self.turn_response_mean),
                      response_max=self.max_new_tokens, observation_len=0.0, env_step_s=0.0)
        n = math.ceil(self.turns)
        return [(replace(one, prompt_len=self.prompt_len + k * step), min(1.0, self.turns - k)) for k in range(n)]

    @property
    def optimizer_steps(self) -> int:
        return self.mini_batches * self.epochs

    @property
    def old_logprob_sequences(self) -> int:
        """Sequences of the old-log-prob pass: with one epoch (and the KL not in the reward) the
        first mini-batch is trained before any update and needs none (rlbatch leaves it out)."""
        if self.epochs == 1 and not self.kl_in_reward:
            return self.sequences - self.sequences // max(1, self.mini_batches)
        return self.sequences

    def distinct_prompts(self, sequences: int) -> int:
        """Distinct prompts among ``sequences`` consecutive sequences of the batch (groups stay together)."""
        return math.ceil(sequences / max(1, self.samples_per_prompt))

    def with_measured(self, generated: float | None, total: float | None, response_max: float | None,
                      rounds: float | None = None) -> Workload:
        """This workload with a run's measured token counts (what one step of that run really did)
        and, with dynamic sampling, its measured generation rounds."""
        w = self
        if rounds is not None and rounds >= 1:
            w = replace(w, generation_rounds=float(rounds))
        if generated is not None and generated > 0:
            w = replace(w, response_mean=float(generated) / w.sequences, response_assumed=False)
        if total is not None and generated is not None and total > generated:
            w = replace(w, prompt_len=(float(total) - float(generated)) / w.sequences, prompt_len_assumed=False)
        if response_max is not None and response_max > 0:
            w = replace(w, response_max=int(round(response_max)))
        elif generated is not None:
            w = replace(w, response_max=max(int(np.ceil(w.response_mean)), w.response_max))
        return w

    def survival(self) -> np.ndarray:
        """Fraction of sequences still generating at each decode step 0..response_max-1.

        (1 - i/M)^k with k chosen so the steps sum to the mean length: everyone starts, the
        last survivor reaches M (the long tail of RL responses). A policy whose responses all
        hit the cap gives all ones.
        """
        return _survival(max(1, self.response_max), float(self.response_mean))

    def to_dict(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences, "prompt_len": self.prompt_len, "response_mean": self.response_mean,
            "response_max": self.response_max, "max_new_tokens": self.max_new_tokens,
            "samples_per_prompt": self.samples_per_prompt,
            "mini_batches": self.mini_batches, "epochs": self.epochs, "grad_accum": self.grad_accum,
            "prompt_len_assumed": self.prompt_len_assumed, "response_assumed": self.response_assumed,
            "generation_rounds": self.generation_rounds, "zero_variance_frac": self.zero_variance_frac,
            "turns": self.turns, "turn_response_mean": self.turn_response_mean,
            "observation_len": self.observation_len, "env_step_s": self.env_step_s, "env_workers": self.env_workers,
            "max_staleness": self.max_staleness,
            "partial_rollouts": self.partial_rollouts,
            **({"image_tokens": self.image_tokens, "image_patches": self.image_patches, "vision_flops": self.vision_flops,
                "train_vision": self.train_vision, "images_assumed": self.images_assumed} if self.image_tokens else {}),
        }


@functools.lru_cache(maxsize=256)
def _survival(m: int, mean: float) -> np.ndarray:
    mean = min(max(mean, 1.0), float(m))
    base = 1.0 - np.arange(m, dtype=float) / m
    lo, hi = 0.0, 1.0
    while (base**hi).sum() > mean and hi < 1e6:  # the sum falls from m (k=0) towards 1 as k grows
        hi *= 2
    for _ in range(60):
        k = (lo + hi) / 2
        lo, hi = (k, hi) if (base**k).sum() > mean else (lo, k)
    out = base ** ((lo + hi) / 2)
    out.flags.writeable = False  # shared through the cache
    return out


def workload_from_config(
    cfg: RLBatchConfig, prompt_len: float | None = None, response_mean: float | None = None,
    zero_variance_frac: float | None = None, turns: float | None = None, observation_len: float | None = None,
    env_step_s: float | None = None,
) -> Workload:
    """The step of ``cfg``. ``response_mean`` <= 1 is read as a fraction of the cap (with
    ``env.name``: of one turn's). ``zero_variance_frac`` (default ``DEFAULT_ZERO_VARIANCE_FRAC``)
    sets dynamic sampling's rounds. With ``env.name``: ``turns`` per trajectory (default, assumed:
    ``env.max_turns``), ``observation_len`` tokens between turns (default, assumed:
    ``DEFAULT_OBSERVATION_LEN``) and ``env_step_s`` seconds per env step (default 0)."""
    algo, lora = cfg.algo, cfg.model.lora
    cap = algo.max_new_tokens
    synthetic = cfg.data.name == "synthetic"
    p = prompt_len if prompt_len is not None else (SYNTHETIC_PROMPT_LEN if synthetic else DEFAULT_PROMPT_LEN)
    shapes = cfg.data.name == "vlm_shapes" and not cfg.model.path and prompt_len is None
    if shapes:  # the built-in visual task with the character tokenizer: known text lengths (images added below)
        p = shapes_prompt_len()
    if response_mean is None:
        mean = DEFAULT_RESPONSE_MEAN_FRAC * cap
    else:
        mean = response_mean * cap if response_mean <= 1 else response_mean
    rounds, frac = 1.0, None
    if algo.dynamic_sampling:
        frac = DEFAULT_ZERO_VARIANCE_FRAC if zero_variance_frac is None else float(zero_variance_frac)
        rounds = expected_rounds(algo.prompts_per_step, frac, algo.max_sampling_rounds)
    w = Workload(
        sequences=algo.prompts_per_step * algo.samples_per_prompt,
        prompt_len=float(p), response_mean=max(1.0, min(float(mean), cap)), response_max=cap,
        max_new_tokens=cap, samples_per_prompt=algo.samples_per_prompt, mini_batches=algo.mini_batches,
        epochs=algo.epochs, grad_accum=algo.grad_accum,
        kl=algo.kl_coef > 0 and (cfg.enabled("reference") or reference_is_actor_base(lora)),
        critic=algo.name == "ppo" and cfg.enabled("critic"),
        kl_in_reward=algo.kl_in_reward and algo.kl_coef > 0,
        entropy=algo.entropy_coef > 0,
        recompute=algo.activation_checkpointing,
        generation_rounds=rounds, zero_variance_frac=frac,
        max_staleness=algo.max_staleness,
        partial_rollouts=bool(algo.partial_rollouts and algo.in_flight_updates and algo.max_staleness > 0),
        prompt_len_assumed=prompt_len is None and not synthetic and not shapes,
        response_assumed=response_mean is None,
        lora_rank=lora.rank, lora_targets=tuple(lora.target_modules or ("all-linear",)), lora_sync=lora.sync,
    )
    w = with_images(w, cfg)
    env = cfg.env
    if not env.name:
        return w
    t = float(min(env.max_turns, turns)) if turns is not None else float(env.max_turns)
    obs = float(observation_len) if observation_len is not None else DEFAULT_OBSERVATION_LEN
    gen = w.response_mean
    if prompt_len is None and cfg.data.name == "none":  # no task prompt: a BOS, then the first observation
        w = replace(w, prompt_len=1.0 + obs, prompt_len_assumed=False)
    workers = (cfg.roles["env"].world_size or 0) if cfg.enabled("env") else 0
    return replace(w, turns=t, turn_response_mean=gen, observation_len=obs, env_step_s=float(env_step_s or 0.0),
                   env_workers=workers,
                   response_mean=t * gen + (t - 1) * obs, response_max=int(env.max_turns * cap + (env.max_turns - 1) * obs),
                   turns_assumed=turns is None or observation_len is None)


def shapes_prompt_len() -> int:
    """Text tokens of the longest ``vlm_shapes`` question in the character tokenizer: its characters
    but the placeholder, plus a BOS and the image's start and end markers (its pads: ``with_images``)."""
    from rlbatch.data.shapes import COLOUR_QUESTION, COUNT_QUESTION, PLACEHOLDER

    return max(len(q.replace(PLACEHOLDER, "")) for q in (COLOUR_QUESTION, COUNT_QUESTION)) + 3


def image_size(cfg: RLBatchConfig) -> tuple[int, int, bool]:
    """(height, width, assumed) of a prompt's image: the built-in visual task's pictures
    (``data.name=vlm_shapes``), else ``DEFAULT_IMAGE_SIDE`` square, assumed."""
    if cfg.data.name == "vlm_shapes":
        from rlbatch.data.shapes import SIZE

        return SIZE, SIZE, False
    return DEFAULT_IMAGE_SIDE, DEFAULT_IMAGE_SIDE, True


def with_images(w: Workload, cfg: RLBatchConfig) -> Workload:
    """``w`` with a vision-language model's image per prompt: its tokens (the tower's resize bounds,
    or ``data.min_pixels`` / ``data.max_pixels`` where the data config has them) added to the prompt,
    the patches and FLOPs of the vision tower, and whether the tower trains. A text model's ``w`` as is."""
    from rlbatch.models.shape import shape_from_config
    from rlbatch.models.spec import vlm_arch

    if vlm_arch(cfg.model) is None:
        return w
    tower = shape_from_config(cfg.model).tower
    if tower is None:
        return w
    height, width, assumed = image_size(cfg)
    lo, hi = getattr(cfg.data, "min_pixels", None), getattr(cfg.data, "max_pixels", None)
    tokens = tower.tokens(height, width, int(lo) if lo else None, int(hi) if hi else None)
    patches = tokens * tower.merge_size ** 2
    return replace(w, prompt_len=w.prompt_len + tokens, image_tokens=float(tokens), image_patches=float(patches),
                   vision_flops=tower.fwd_flops(patches), train_vision=bool(getattr(cfg.model, "train_vision", False)),
                   images_assumed=assumed)
