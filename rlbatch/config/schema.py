"""The configuration schema: every field, its type, its default and what it means.

Plain dataclasses (no Hydra import here, so the placement code can read field names without
pulling Hydra in). ``rlbatch.config.register`` registers them in Hydra's ConfigStore; the YAML under
``rlbatch/conf/`` only composes and overrides them. Every int and float field declares its range
(``bounded(default, ge=..., le=...)``, ``rlbatch.config.bounds``): validation refuses a value of
the wrong type, a non-finite one, and one out of its range, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rlbatch.config.bounds import TIMEOUT_MAX_S, bounded
from rlbatch.config.hardware_section import HardwareConfig
from rlbatch.config.limits import Limits

GPU_ROLES = ("actor_train", "actor_infer", "reference", "critic")
"""Roles that always hold a model on GPUs. ``reward`` may be a GPU model or a CPU rule; any other
role name is a CPU role (e.g. ``code_sandbox``)."""
TRAINABLE_ROLES = ("actor_train", "critic")
"""Roles with an optimizer: their state is trained and checkpointed."""
INHERIT_BACKEND = ("reference", "critic")
"""Roles whose empty backend inherits actor_train's (AReaL's rule)."""
INHERIT_DEVICE_MAPPING = ("critic",)
"""Roles that run colocated with actor_train (its device_mapping) when they give none."""
VALUE_ROLES = ("critic",)
"""Roles whose model is a value model (the policy's architecture with a scalar head per token)."""
HEADS = {"critic": "value", "reward": "reward"}
"""The head of a role's model when it is not the policy's language-model head ('lm'): 'value' (a
scalar per token) or 'reward' (a sequence-classification model: one score per sequence)."""


@dataclass
class RoleConfig:
    """Where one role runs and with which engine."""

    enabled: bool = True
    """False switches the role off (GRPO has no critic)."""
    device_mapping: Any = None
    """Global GPU ranks: a list of ints, or a string such as 'list(range(0,8))' or '[0,1]+range(4,6)'.
    Parsed by a small grammar, never evaluated. Absent for CPU roles."""
    backend: str = ""
    """'<engine>:<dims>' such as 'fsdp:d4t2', 'vllm:d2t4', 'megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)'.
    Empty for CPU roles; reference and critic inherit actor_train's when empty."""
    num_gpus_per_worker: int | None = None
    """GPUs per engine instance: 1 for training engines, t*p for inference. Derived when absent."""
    world_size: int | None = None
    """Number of workers. GPU roles: len(device_mapping) / num_gpus_per_worker (derived when absent).
    CPU roles: required."""
    offload: bool = True
    """Move this role's device state to pinned host memory while a colocated role has the GPU."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Settings of the role's engine, typed and documented per engine in its package
    (``rlbatch/engines/<name>/__init__.py``; e.g. fsdp: micro_batch, share_prompts, single_unit_max_mb,
    sync_bucket_mb; hf: max_batch, share_prompts). Unknown keys are refused before anything starts;
    ``python -c "from rlbatch.engines.registry import describe; print(describe())"`` lists them."""


def default_roles() -> dict[str, RoleConfig]:
    """The default placement: actor_train, actor_infer and reference colocated on 2 GPU ranks.

    Roles are a mapping of any role name (a CPU role can be added from the command line:
    ``+roles.code_sandbox.world_size=8``); Hydra composes them as plain mappings
    (``rlbatch.config.register``), ``rlbatch.config.parse`` types them and ``place()`` places them.
    """
    return {
        "actor_train": RoleConfig(device_mapping=[0, 1], backend="fsdp:d2"),
        "actor_infer": RoleConfig(device_mapping=[0, 1], backend="hf:d2"),
        "reference": RoleConfig(device_mapping=[0, 1]),
        "critic": RoleConfig(enabled=False),
        "reward": RoleConfig(world_size=1),
    }


@dataclass
class ClusterConfig:
    """Where the job runs: this machine (mpiexec) or a Slurm allocation (submitit + srun)."""

    name: str = "local"
    """'local' starts every rank here with mpiexec; 'slurm' submits one sbatch job."""
    gpus_per_node: int = bounded(8, ge=1, le=1024, checked_by_place=True)
    """GPUs on each node. GPU rank r lives on node r // gpus_per_node."""
    nodes: int | None = bounded(None, ge=1, le=65536, checked_by_place=True)
    """Nodes to use. Derived from the placement when absent."""
    cpus_per_task: int = bounded(1, ge=1, le=1024, checked_by_place=True)
    """CPU cores for each process (GPU ranks, CPU workers and the controller)."""
    mem_gb: int | None = bounded(None, ge=1, le=2**53 - 1, why="Slurm counts memory in MB in 63 bits")
    """Memory per node in GB (sbatch --mem). Slurm's default when absent."""
    partition: str | None = None
    """Slurm partition (sbatch --partition)."""
    time_min: int = bounded(60, ge=1, le=2**32 - 3,
                            why="Slurm holds minutes in 32 bits; its two largest values mean 'unlimited' and 'unset'")
    """Slurm time limit in minutes (sbatch --time)."""
    account: str | None = None
    """Slurm account (sbatch --account)."""
    qos: str | None = None
    """Slurm QOS (sbatch --qos)."""
    constraint: str | None = None
    """Slurm node features (sbatch --constraint)."""
    job_name: str = "rlbatch"
    """Slurm job name."""
    sbatch_args: dict[str, Any] = field(default_factory=dict)
    """Any other '#SBATCH --key=value' lines, e.g. {exclusive: true, reservation: r1}."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun arguments, e.g. ['--cpu-bind=none']."""
    mpi: str = "pmi2"
    """srun --mpi plugin. pmi2 works with the mpich wheel; use pmix with an OpenMPI build."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the sbatch script before srun (module load ..., source venv)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for every rank."""
    network_interface: str | None = None
    """Multi-node: the network interface torch.distributed uses between nodes, e.g. 'ib0' or
    'eth0' (one name, the same on every node); every rank gets it as NCCL_SOCKET_IFNAME and
    GLOO_SOCKET_IFNAME. Unset, NCCL and gloo pick an interface themselves, which can be one the
    other nodes cannot reach (a docker bridge, a management network)."""
    container_image: str | None = None
    """Container image for every rank (pyxis: srun --container-image)."""
    container_mounts: str | None = None
    """Container mounts (pyxis: srun --container-mounts=src:dst,...)."""
    mpiexec: str = ""
    """Local launcher: path of mpiexec. Empty uses the one installed beside this Python
    (the mpich wheel's); set it to use a system MPI."""
    mpiexec_args: list[str] = field(default_factory=list)
    """Extra arguments for the local mpiexec."""
    port_range: list[int] = field(default_factory=lambda: [20000, 40000])
    """[low, high): torch.distributed rendezvous ports are derived from the job id in this range."""
    timeout_s: float = bounded(600.0, ge=1e-3, le=TIMEOUT_MAX_S, why="Python's waits overflow beyond it")
    """Limit for the controller's wait for each phase's replies and for the collectives of the global
    and weight-sync groups; on expiry the error names the phase, the role, the ranks and the
    operation (README, "Timeouts: what ends a hang")."""
    startup_timeout_s: float = bounded(1800.0, gt=0, le=TIMEOUT_MAX_S, why="Python's waits overflow beyond it")
    """How long the controller waits for every rank to load its models and build its engines
    before the first step (a large checkpoint can take longer than one collective)."""
    sync_check_every: int = bounded(50, ge=0, le=2**31 - 1)
    """The checked sync (README, "Checked sync"): after the first weight sync of a synchronous run and the
    sync of every N-th policy version, the inference engine's log-probs of a fixed probe must equal
    the trainer's to the engine's tolerance, or the run stops naming the role, the step and the
    numbers; 0: never. Each check costs a short generation and a forward (plus one before the first
    step); runs with ``algo.max_staleness`` > 0 are not checked."""
    device: str = "auto"
    """'cuda', 'cpu', or 'auto' (cuda when available). On 'cpu', GPU ranks are logical."""
    preempt_signal: str = "USR2"
    """Signal that means 'save and requeue' (Slurm sends it signal_delay_s before the time limit:
    sbatch --signal). Not USR1, which NCCL uses."""
    signal_delay_s: int = bounded(120, ge=0, le=65535, why="sbatch --signal takes at most 65535 s")
    """Seconds before the time limit at which Slurm sends preempt_signal."""
    deadline_margin_s: float = bounded(60.0, ge=0)
    """Save and requeue when the next step plus a checkpoint would end closer than this to the
    job's time limit, even if no signal comes."""


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy (docs/lora.md): the trained role learns ``rank``-r adapters of
    the ``target_modules`` linear layers through PEFT while the base weights stay frozen; inference
    engines get the merged weights, or the adapters alone where they load them (``sync``)."""

    rank: int = bounded(0, ge=0)
    """Adapter rank r; 0: no adapters (full fine-tuning)."""
    alpha: float = bounded(32.0, gt=0, why="the adapters' scale is alpha / rank")
    """The adapters' scale is alpha / rank (32: twice rank 16, the common choice)."""
    dropout: float = bounded(0.0, ge=0, le=0.9, why="a probability; above 0.9 the adapters see almost no input")
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Names (suffixes) of the linear layers that get adapters, e.g. [q_proj, v_proj]; 'all-linear':
    every linear layer of the decoder (not the LM head)."""
    sync: str = "auto"
    """What the weight sync moves into the inference engine: 'merged' (every weight, the adapters
    merged in), 'adapter' (the adapters alone; the engine keeps the base it started with), 'auto':
    the adapters where the inference engine loads them (vllm), else merged (hf)."""


@dataclass
class ModelConfig:
    """The policy model. A local HF directory, or a small random-initialised architecture.

    Either way the run's model is one ``rlbatch.models.spec.ModelSpec`` (from ``path``'s
    config.json, or from the random-init fields below): the engines build the random-init model
    from it and the planner counts the same spec. A random-init model's vocabulary is the
    tokenizer's (the built-in character tokenizer's: its special tokens and its alphabet), not a field.
    """

    path: str | None = None
    """Local Hugging Face model directory (weights, config, tokenizer). Nothing is downloaded."""
    check_path: bool = True
    """Refuse to start or submit when ``path`` is not a model directory (with a config.json) on
    the machine that launches. Set false when only the compute nodes see it (a node-local copy,
    a filesystem the login node does not mount)."""
    arch: str = "qwen2"
    """Architecture of a random-initialised model when no path is given: 'qwen2' (q/k/v biases),
    'llama' (no biases) or 'qwen2_moe' (Qwen2 attention; every layer's MLP a Mixture of Experts:
    routed experts and a gated shared expert); 'qwen2_vl' / 'qwen2_5_vl': a vision-language model
    (Qwen2-VL / Qwen2.5-VL), its language model the Qwen2 decoder of the fields below, its vision
    tower ``rlbatch.models.vlm.VisionSpec``'s (docs/vlm.md)."""
    hidden_size: int = bounded(64, ge=1)
    """Random-init model: hidden size."""
    intermediate_size: int = bounded(256, ge=1)
    """Random-init model: MLP size."""
    num_layers: int = bounded(2, ge=1)
    """Random-init model: transformer layers."""
    num_heads: int = bounded(4, ge=1)
    """Random-init model: attention heads."""
    num_kv_heads: int = bounded(2, ge=1)
    """Random-init model: key/value heads (grouped-query attention)."""
    num_experts: int = bounded(4, ge=1)
    """Random-init qwen2_moe model: routed experts per layer (other archs: unused)."""
    num_experts_per_token: int = bounded(2, ge=1)
    """Random-init qwen2_moe model: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = bounded(64, ge=1)
    """Random-init qwen2_moe model: MLP size of one routed expert."""
    shared_expert_intermediate_size: int = bounded(128, ge=1)
    """Random-init qwen2_moe model: MLP size of the shared expert every token passes through."""
    max_position_embeddings: int = bounded(128, ge=1)
    """Random-init model: longest sequence (sizes the rotary tables; no parameters)."""
    tie_word_embeddings: bool = True
    """Random-init model: share input embedding and output projection."""
    initializer_range: float = bounded(0.02, gt=0, why="the std of the initial weights")
    """Random-init model: std of the initial weights. 0.02 is Hugging Face's; at width 64 it leaves
    the logits nearly flat and learning stalls, so the arithmetic experiment sets 0.1."""
    dtype: str = "auto"
    """'auto' (bf16 on GPU, fp32 on CPU), 'bf16', 'fp16' or 'fp32'."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (``lora.rank`` > 0)."""
    train_vision: bool = False
    """Vision-language model: train the vision tower too. False: its parameters (``model.visual.*``)
    stay frozen (no gradient, no optimizer state), the patch merger included; the language model
    trains either way."""


@dataclass
class AlgoConfig:
    """The RL algorithm: GRPO by default (group-normalised advantages, PPO-clip, KL to reference)."""

    name: str = "grpo"
    """The program (controller loop) from ``rlbatch.algos.registry.LOOPS``: 'grpo', 'dr_grpo',
    'dapo', 'gspo', 'rloo' and 'reinforce_pp' all run the critic-free policy-gradient loop (the
    presets in conf/algo/ set the parts below); 'ppo' runs PPO with the critic role (values,
    GAE advantages, critic training; preset conf/algo/ppo.yaml)."""
    advantage: str = "grpo"
    """Advantage estimator from ``rlbatch.algos.registry.ADVANTAGES``: 'grpo' (group mean and std),
    'dr_grpo' (group mean only), 'rloo' (leave-one-out mean), 'reinforce_pp' (per-token returns
    whitened over the batch), 'reinforce_pp_baseline' (the same after the group mean), 'gae'
    (PPO: generalised advantage estimation over the critic's values; algo.name=ppo only)."""
    policy_loss: str = "ppo_clip"
    """Policy loss from ``rlbatch.algos.registry.POLICY_LOSSES``: 'ppo_clip' (per-token ratio, clipped
    with clip_low/clip_high) or 'gspo' (one length-normalised ratio per sequence, clipped as a whole)."""
    prompts_per_step: int = bounded(16, ge=1)
    """Prompts drawn per step."""
    samples_per_prompt: int = bounded(8, ge=1)
    """Responses generated per prompt (the GRPO group size)."""
    max_new_tokens: int = bounded(8, ge=1)
    """Longest response, in tokens."""
    temperature: float = bounded(1.0, ge=0, why="0 samples greedily")
    """Sampling temperature for generation."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    lr: float = bounded(1e-3, ge=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear learning-rate warm-up steps."""
    grad_clip: float = bounded(1.0, ge=0)
    """Clip the gradient norm to this (0 disables)."""
    mini_batches: int = bounded(2, ge=1)
    """Optimizer steps per batch (the batch is split into this many mini-batches)."""
    epochs: int = bounded(1, ge=1)
    """Passes over each batch."""
    grad_accum: int = bounded(1, ge=1)
    """Micro-batches per mini-batch (gradient accumulation)."""
    clip_low: float = bounded(0.2, ge=0)
    """PPO ratio clip below 1 (1 - clip_low)."""
    clip_high: float = bounded(0.28, ge=0)
    """PPO ratio clip above 1 (1 + clip_high)."""
    kl_coef: float = bounded(0.01, ge=0)
    """Weight of the KL to the reference (0 disables the reference role's work)."""
    kl_estimator: str = "k3"
    """KL estimator from ``rlbatch.algos.registry.KL_ESTIMATORS``: 'k1', 'k2', 'k3' or 'abs'."""
    kl_in_reward: bool = False
    """Subtract kl_coef * KL from the reward instead of adding it to the loss: per token for the
    per-token estimators (reinforce_pp*), summed over the response for the sequence-level ones."""
    gamma: float = bounded(1.0, gt=0, le=1, why="a discount")
    """Discount of the per-token returns (reinforce_pp*, and GAE's gamma for PPO), in (0, 1]."""
    lam: float = bounded(0.95, ge=0, le=1, why="GAE's lambda")
    """PPO: GAE's lambda in [0, 1] (1: Monte-Carlo returns minus the value; 0: one-step TD)."""
    value_clip: float = bounded(0.2, ge=0, why="0 disables value clipping")
    """PPO: clip each value prediction to within this of its value before the updates (PPO2's
    clipped value loss); 0 disables it."""
    whiten_advantages: bool = True
    """PPO: subtract the batch's mean advantage and divide by its std, over every response token."""
    critic_lr: float | None = bounded(None, gt=0, why="a learning rate; null: algo.lr")
    """PPO: the critic's peak learning rate (AdamW; same warm-up as the actor's). None: algo.lr."""
    critic_warmup_steps: int = bounded(0, ge=0)
    """PPO: steps at the start of a run that train the critic only (the actor and the inference
    weights stay as they are), so the first policy updates use values that fit the task."""
    entropy_coef: float = bounded(0.0, ge=0, why="the loss adds the bonus only when > 0")
    """Entropy bonus weight."""
    loss_agg: str = "token"
    """Loss aggregation from ``rlbatch.algos.registry.AGGREGATIONS``: 'token' (mean over all tokens),
    'seq' (mean over sequences of per-sequence means) or 'seq_sum' (per-sequence token sums over
    the constant max_new_tokens, averaged over sequences: Dr.GRPO)."""
    adv_eps: float = bounded(1e-6, gt=0, why="a group of equal rewards would divide 0 by 0")
    """Added to the std when normalising advantages (group std, or the batch's token std)."""
    overlong_buffer: int = bounded(0, ge=0)
    """DAPO's overlong shaping: responses longer than max_new_tokens - overlong_buffer tokens lose up
    to overlong_penalty reward, linearly over the buffer. 0 disables it."""
    overlong_penalty: float = bounded(1.0, ge=0)
    """The reward lost by a response of max_new_tokens tokens under overlong shaping."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: generate and score more rounds of prompts_per_step prompts until
    the batch holds prompts_per_step groups whose rewards are not all equal."""
    max_sampling_rounds: int = bounded(3, ge=0)
    """Dynamic sampling's cap on generation rounds per step (>= 1; at the cap a short batch is
    filled with zero-variance groups)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    max_staleness: int = bounded(0, ge=0)
    """Asynchronous off-policy training on a disaggregated placement: while actor_train trains on
    step s, actor_infer already generates the batches of steps up to s + max_staleness with the
    weights it has, so no sample is trained on more than max_staleness policy versions after the
    one that generated it. 0: the synchronous loop. A placement whose actor_infer shares ranks
    with another GPU role runs synchronously (and says so once)."""
    in_flight_updates: bool = False
    """Weights land mid-generation (needs max_staleness > 0, actor_infer on GPUs of its own, an
    engine that pauses between decode steps: vllm or sglang, one rank per worker): a weight sync no longer
    waits for the generation in flight; the engine pauses between two engine steps, loads the new
    weights and goes on with the same sequences, each token recording the policy version that
    sampled it (docs/async.md)."""
    partial_rollouts: bool = False
    """With in_flight_updates (and max_staleness >= 2): the inference engine keeps its requests
    across steps. A step's batch is the first prompts_per_step groups to finish; longer samples go
    on generating, under the weights that land meanwhile, into a later step's batch. Generation
    runs one step ahead; a sample whose oldest token is past max_staleness is dropped (docs/async.md)."""
    in_flight_kv: str = "keep"
    """With in_flight_updates, the KV cache of the sequences in flight when weights land: 'keep'
    (computed under the old weights and reused, as PipelineRL and NeMo-RL do by default) or
    'recompute' (vLLM preempts them, SGLang retracts them, and prompt + tokens so far are prefilled
    again under the new weights)."""
    off_policy: str = "none"
    """Correction for tokens sampled by an older (or numerically different) policy, from
    ``rlbatch.algos.registry.OFF_POLICY``: 'none', 'tis' (truncated importance sampling with
    tis_cap), 'mask' (tokens whose ratio leaves [mask_ratio_low, mask_ratio_high] leave the loss),
    'seq_tis' / 'seq_mask' (the same on each sequence's geometric-mean ratio, with seq_tis_cap /
    [seq_mask_low, seq_mask_high]). The ratio is the trainer's policy before the step's updates
    over the behaviour log-prob the inference engine returned with each token."""
    tis_cap: float = bounded(2.0, ge=1)
    """off_policy=tis: the importance weight's upper bound (>= 1)."""
    mask_ratio_low: float = bounded(0.5, gt=0, le=1)
    """off_policy=mask: tokens with a ratio below this leave the loss (in (0, 1])."""
    mask_ratio_high: float = bounded(2.0, ge=1)
    """off_policy=mask: tokens with a ratio above this leave the loss (>= 1)."""
    seq_tis_cap: float = bounded(2.0, ge=1)
    """off_policy=seq_tis: the upper bound (>= 1) of a sequence's weight, its geometric-mean ratio
    exp(mean over its tokens of log r_t)."""
    seq_mask_low: float = bounded(0.99, gt=0, le=1)
    """off_policy=seq_mask: a sequence whose geometric-mean ratio is below this leaves the loss
    (in (0, 1]; a per-token average, so far closer to 1 than mask_ratio_low)."""
    seq_mask_high: float = bounded(1.01, ge=1)
    """off_policy=seq_mask: a sequence whose geometric-mean ratio is above this leaves the loss (>= 1)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: a truncated response (max_new_tokens tokens, not ending with EOS) is
    kept out of the loss: its tokens weigh 0 and do not count in the aggregation's token count."""


def role_algo(role: str, algo: AlgoConfig) -> AlgoConfig:
    """The algorithm settings a role's engine trains with: a value role's peak learning rate is
    ``critic_lr`` when set."""
    if role in VALUE_ROLES and algo.critic_lr is not None:
        return replace(algo, lr=float(algo.critic_lr))
    return algo


@dataclass
class DataConfig:
    """Where prompts come from: the built-in synthetic task, or a jsonl/parquet file."""

    name: str = "synthetic"
    """'synthetic' (built-in arithmetic task), 'file', 'synthetic_code' (built-in code task),
    'code_file' (MBPP/HumanEval-style records with tests; see rlbatch/data/code.py) or 'none' (no
    prompts: with env.name, every episode's task is drawn by the env from its seed)."""
    path: str | None = None
    """jsonl or parquet file for name=file."""
    check_path: bool = True
    """Refuse to start or submit when ``path`` does not exist on the machine that launches. Set
    false when only the compute nodes see it."""
    layout: str = "auto"
    """Records of name=file: 'flat' ({"question": ..., "answer": ...}), 'verl' (verl's: 'prompt' chat
    messages, 'reward_model.ground_truth', 'data_source'), or 'auto' (verl's when the first record has
    'prompt' and 'reward_model', else flat). Unusable records are skipped and counted (docs/data.md)."""
    prompt_key: str | None = None
    """Field (a dotted path) of each record that holds the question (text) or chat messages; None: the
    layout's ('question', verl: 'prompt')."""
    answer_key: str | None = None
    """Field (a dotted path) of each record that holds the reference answer; None: the layout's
    ('answer', verl: 'reward_model.ground_truth')."""
    data_source_key: str | None = None
    """Field (a dotted path) naming the record's source, which data.reward_fns routes by; None:
    'data_source'. A record without it gets data.reward_fn."""
    template: str = "{question}"
    """Prompt template; '{question}' is replaced by the record's question (not applied to chat messages)."""
    chat_template: bool = False
    """Render each prompt with the tokenizer's chat template (model.path's; refused before start when
    it has none): chat messages as they are, a question as one user message, with the generation prompt."""
    system_prompt: str | None = None
    """With chat_template: a system message put first, unless a record's messages open with their own."""
    reward_fn: str = "rlbatch.rewards.rules:exact_match"
    """Dotted path 'module:function' of the reward function (completion, answer) -> float; with
    reward_fns, the one for data sources it does not name."""
    reward_fns: dict[str, str] = field(default_factory=dict)
    """data_source -> reward function ('module:function') for records from that source, e.g.
    {"openai/gsm8k": "rlbatch.rewards.math:gsm8k_match"}; other sources get reward_fn."""
    max_prompt_tokens: int = bounded(0, ge=0)
    """Longest prompt in tokens, as the ranks encode it (after the template and the chat template,
    special tokens included); 0: no limit. What happens to a longer one: ``prompt_too_long``."""
    prompt_too_long: str = "refuse"
    """A prompt over ``max_prompt_tokens``: 'refuse' (the run does not start: its index, length and
    the limit are named), 'drop' (left out of the data set, counted) or 'truncate' (cut to the
    limit on ``truncation_side``, counted). docs/data.md, "Prompt length"."""
    truncation_side: str = "left"
    """Where 'truncate' cuts: 'left' keeps the end of the prompt (where the question and the
    generation prompt usually are), 'right' keeps its start."""


@dataclass
class SandboxConfig:
    """How the ``code_sandbox`` role runs responses against their tests (docs/sandbox.md)."""

    isolation: str = "auto"
    """'namespaces' (own user/mount/pid/network namespaces via util-linux unshare: no network, a
    read-only view of the node, private /tmp), 'process' (resource limits, a private directory, a
    seccomp filter that keeps the code from signalling or tracing other processes and from opening
    any socket but AF_UNIX ones, Landlock's file-system limits where the kernel has them, and a uid
    of its own per execution when the worker runs as root; the node's processes and, without Landlock, its files
    are NOT isolated: the log says what is), or 'auto' (namespaces
    where the node allows them; the log says which is in force). 'namespaces' is a hard
    requirement: a node without them is refused, never a fallback. docs/sandbox.md."""
    scoring: str = "fraction"
    """Reward of a response: 'fraction' of its tests passed, or 'all' (1 only when every test passes)."""
    code_weight: float = bounded(1.0, ge=0)
    """Weight of the sandbox's reward in the total reward."""
    rule_weight: float = bounded(0.0, ge=0)
    """Weight of data.reward_fn (scored by the reward role, which must then be enabled) in the total."""
    workers: int = bounded(0, ge=0)
    """Executions at once per code_sandbox process (0: the CPUs it may use)."""
    cache: int = bounded(100_000, ge=0)
    """Outcomes kept per process, keyed by program and tests (0: run every response)."""
    limits: Limits = field(default_factory=Limits)


@dataclass
class RewardModelConfig:
    """The reward role as a model on GPUs (``roles.reward`` given a device_mapping and a backend such
    as 'fsdp:d2'): a sequence-classification model scores each prompt + response (docs/algorithms.md)."""

    path: str | None = None
    """Local Hugging Face directory of an ``AutoModelForSequenceClassification`` with one label (and its
    tokenizer). None: the policy's model (model.path or its random initialisation) with a scalar head
    initialised from the seed; for tests and plumbing, it knows nothing about the task."""
    check_path: bool = True
    """Refuse to start or submit when ``path`` does not exist on the machine that launches."""
    model_weight: float = bounded(1.0, ge=0)
    """Weight of the model's score in the reward role's reward."""
    rule_weight: float = bounded(0.0, ge=0)
    """Weight of data.reward_fn's score, computed on the reward ranks beside the model's."""


@dataclass
class CriticModelConfig:
    """Where PPO's critic starts from (docs/algorithms.md)."""

    path: str | None = None
    """Local Hugging Face directory: a token-classification model with one label (e.g. a critic
    exported with ``python -m rlbatch.export RUN DIR --role critic``) loads as it is; a causal LM gives
    the body, with the value head at zero. It must read the policy's token ids (the same tokenizer).
    None: the policy's own weights (model.path or its random initialisation)."""
    check_path: bool = True
    """Refuse to start or submit when ``path`` does not exist on the machine that launches."""


@dataclass
class EnvConfig:
    """Multi-turn rollouts: the environment each trajectory plays, its tools and limits
    (docs/agents.md). Unset ``name``: no environment, one prompt and one response per sample."""

    name: str | None = None
    """A registered environment ('running_sum', 'lookup', 'frozenlake', or one a module in
    ``plugins`` registers), or a plugin path 'package.module:Class' imported by name. None: no env."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env's constructor (e.g. running_sum: {turns: 3, scoring: all})."""
    max_turns: int = bounded(8, ge=1)
    """Policy actions per trajectory; the trajectory ends (reason 'max_turns') at the last one."""
    max_context_tokens: int | None = bounded(None, ge=1)
    """Longest trajectory in tokens (prompt, actions and observations); a longer one ends (reason
    'max_context'). None: the model's longest sequence."""
    step_timeout_s: float = bounded(30.0, gt=0, le=TIMEOUT_MAX_S, why="Python's waits overflow beyond it")
    """Longest one call into the env (building and reset, a step, a turn's tool calls); a call that
    outlives it ends its trajectory (reason 'timeout') and is abandoned, the job goes on."""
    tool_call_format: str = "json"
    """What a tool call is between its tags: 'json' ({"name": ..., "arguments": {...}}, Qwen2.5's
    format) or 'compact' (``name(arg, key=value)``, or the bare arguments for the episode's only
    tool: a format a character model with a small alphabet can write; docs/agents.md)."""
    tool_call_tags: list[str] = field(default_factory=lambda: ["<tool_call>", "</tool_call>"])
    """[open, close] around a tool call in an action (the close tag may end the action in the
    compact format)."""
    tool_response_tags: list[str] = field(default_factory=lambda: ["<tool_response>", "</tool_response>"])
    """[open, close] around each tool call's output in the observation."""
    observation_role: str = "user"
    """With data.chat_template: the role of the message each observation becomes ('tool' where the
    model's template renders tool messages); the template's text around it is appended with it."""
    tools: list[str] = field(default_factory=list)
    """Registered tools every episode may call besides the env's own (e.g. ['python']: the code
    sandbox with sandbox.isolation and sandbox.limits)."""
    reward_fn_weight: float = bounded(0.0, ge=0)
    """A trajectory's reward is its env rewards' sum plus this weight times data.reward_fn of its
    whole response (turns and observations) and the record's answer; 0: the env's alone."""


@dataclass
class EvalConfig:
    """Held-out evaluation during training (docs/eval.md): the current policy generates for every
    prompt of ``data``, scored as training is (``data.reward_fns`` routes by data source), without
    touching the training run's data stream or random streams."""

    every: int = bounded(0, ge=0)
    """Evaluate after every N steps' weight sync (and after the last step); 0: never."""
    at_start: bool = False
    """Also evaluate the initial weights, before the first step (logged in the first step's row)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The held-out prompts, in the data section's shape (name, path, layout, keys, template,
    chat_template, reward_fn, reward_fns); read in file order, never shuffled."""
    holdout: int = bounded(0, ge=0)
    """Evaluate on this many problems of the training data instead of ``data``: a fixed draw
    (``holdout_seed``) that the training stream leaves out, whether or not evaluation runs."""
    holdout_seed: int = bounded(0, ge=0)
    """The seed of the held-out draw (not the run's seed: every run of a data set holds out the same)."""
    max_prompts: int = bounded(0, ge=0)
    """Evaluate on the first N prompts of ``data`` (0: all of them)."""
    samples_per_prompt: int = bounded(1, ge=1)
    """Responses per prompt (k of pass@k)."""
    temperature: float = bounded(0.0, ge=0, why="0 samples greedily")
    """Sampling temperature of evaluation; 0 (greedy) needs samples_per_prompt=1 (greedy samples
    are all alike). top_p and max_new_tokens are the algorithm's."""
    correct_at: float = bounded(1.0, gt=0, why="a reward of 0 would count every response as correct")
    """A response counts as correct (pass@k) when its reward is at least this."""
    checkpoint: str = ""
    """program=eval: the checkpoint to evaluate: a checkpoint directory, or a run directory or its
    ``checkpoints/`` (the newest complete one there); empty: the weights of ``model.path``."""
    all_checkpoints: bool = False
    """program=eval with a run or ``checkpoints/`` directory in ``checkpoint``: evaluate each of its
    complete checkpoints, oldest first, instead of the newest only."""


@dataclass
class WandbConfig:
    """Weights & Biases (docs/recipes.md, "Trackers")."""

    enabled: bool = False
    """Log each step's metrics row, with the config and the placement as the run's config, to W&B."""
    mode: str = "offline"
    """'offline': the run is written under <run_dir>/wandb, no network needed (upload it later with
    ``wandb sync --id <id> <run_dir>/wandb/offline-run-*``); 'online': streamed to the W&B server from
    the controller's node (needs network there and an API key, e.g. WANDB_API_KEY in the job's environment)."""
    project: str = "rlbatch"
    """W&B project."""
    entity: str | None = None
    """W&B team or user; None: the API key's default entity."""
    name: str | None = None
    """Display name of the run; None: the run directory's name."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run (each 1 to 64 characters)."""


@dataclass
class MlflowConfig:
    """MLflow (docs/recipes.md, "Trackers")."""

    enabled: bool = False
    """Log each step's metrics row, and the config and the placement as the run's parameters, to MLflow."""
    tracking_uri: str | None = None
    """A file store (a path, relative ones to run_dir, or a 'file:' URI) or an MLflow server
    ('http(s)://host:port'); None: the file store <run_dir>/mlruns."""
    experiment: str = "rlbatch"
    """Experiment the run belongs to (created when missing)."""
    run_name: str | None = None
    """Name of the run; None: the run directory's name."""


@dataclass
class TrackersConfig:
    """Experiment trackers, besides metrics.jsonl and TensorBoard (``logger``). Only the
    controller logs; a requeued or resumed job reattaches to the same tracker run, by the id kept in
    <run_dir>/trackers.json, and logs no step twice. A tracker that fails while the run trains
    (a server down) is warned about and retried, and training goes on."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class WatchConfig:
    """What a user sees of a run while it trains (docs/inspect.md): sample completions, the reward
    plot, and the training batches kept for ``python -m rlbatch.inspect``."""

    samples_every: int = bounded(10, ge=0)
    """Write sample completions (prompt, response, reward, advantage; a trajectory's turns and end)
    to <run_dir>/samples.jsonl, TensorBoard and the trackers at step 0, every N-th step after it and
    the last step; 0: never."""
    samples_per_step: int = bounded(4, ge=1, le=1024)
    """Samples shown each such step: the step's first ones, in group order (a prompt's samples
    together, so their rewards and advantages compare)."""
    plot_every: int = bounded(10, ge=0)
    """Redraw <run_dir>/reward_curve.png (and eval_curve.png) every N steps while the run trains;
    0: only at the end."""
    batch_every: int = bounded(0, ge=0)
    """Keep the training batch of step 0 and every N-th step after it, as the trainer read it
    (tokens, loss mask, behaviour log-probs, rewards, advantages), in <run_dir>/batches/step_<N>.pt;
    0: never. Costs one read of the samples off the trainer's ranks on those steps."""


@dataclass
class RLBatchConfig:
    """One rlbatch run."""

    run_dir: str = "runs/${now:%Y-%m-%d_%H-%M-%S}"
    """Where logs, metrics and checkpoints go. Stays the same across Slurm requeues."""
    seed: int = bounded(1, ge=0, le=2**32 - 1, why="vLLM seeds numpy with it")
    """Seed for every rank (each rank derives its own stream from it)."""
    steps: int = bounded(60, ge=1)
    """RL steps to run."""
    save_every: int = bounded(0, ge=0)
    """Checkpoint every N steps (0: only at the end and on preemption)."""
    keep_checkpoints: int = bounded(3, ge=1)
    """Keep the newest N complete checkpoints in <run_dir>/checkpoints."""
    resume: str = "auto"
    """'auto' (newest complete checkpoint in run_dir), 'never', or a checkpoint path."""
    program: str = "train"
    """'train' runs RL; 'eval' evaluates a checkpoint or model.path on the eval set without training
    (docs/eval.md); 'selftest' checks the placement on real processes (identity and collectives)."""
    dry_run: bool = False
    """Print the placement and the sbatch script, start nothing."""
    wait: bool = False
    """cluster=slurm: follow the job to the end and exit with its code."""
    experiment: str = "default"
    """Name of the experiment preset (set by rlbatch/conf/experiment/*.yaml)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported (by name) before the configuration is validated and on every rank:
    each may register engines (``rlbatch.engines.registry.register``) or algorithm parts
    (``rlbatch.algos.registry``)."""
    hardware: HardwareConfig | None = None
    """Hardware profile for the planner (rlbatch/conf/hardware/<name>.yaml: FLOP/s, memory, bandwidths):
    ``hardware=<name>``, its fields overridden by ``hardware.<field>=<value>`` (``HardwareConfig``)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    roles: dict[str, RoleConfig] = field(default_factory=default_roles)
    """Role name -> RoleConfig. See RoleConfig."""
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    critic_model: CriticModelConfig = field(default_factory=CriticModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    logger: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where each step's metrics row goes besides metrics.jsonl: 'tensorboard' (event files under
    <run_dir>/tensorboard) and trackers by name, e.g. ``logger=[tensorboard,wandb,mlflow]`` (their
    settings under ``trackers.<name>``; ``trackers.<name>.enabled=true`` turns one on as well)."""
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)

    def enabled(self, role: str) -> bool:
        """Whether the config has ``role`` and leaves it on."""
        rc = self.roles.get(role)
        return rc is not None and rc.enabled
