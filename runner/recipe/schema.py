"""The recipe as frozen attrs classes: one class per TOML table, one default and help text per key.

Nothing here imports torch. Empty strings (and empty lists, zero counts) mean "not set": TOML has
no null, and this keeps a resolved recipe round-trippable.
"""

from typing import Any, Literal

import attrs

from runner.recipe.algo_configs import (  # noqa: F401 - the recipe's classes are read from here
    ALGO_KINDS,
    DEFAULT_KIND,
    AlgoConfig,
    DPOConfig,
    GRPOConfig,
    OPDConfig,
    PPOConfig,
    RMConfig,
    SFTConfig,
)
from runner.recipe.fields import default_of, key, table  # noqa: F401

CursorResume = Literal["strict", "auto", "off"]
# Where metrics rows go (logging.report_to); runner.ui.trackers implements each.
Tracker = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


@attrs.frozen
class RunConfig:
    name: str = key("run", "Name of the run, shown in the UI and the summary.")
    output_dir: str = key(
        "runs/run", "Folder for checkpoints, metrics.jsonl and recipe.resolved.toml."
    )
    seed: int = key(0, "Seed for data order, sampling and initialisation.")
    max_steps: int = key(
        100, "Number of optimizer steps (one step = one batch of prompts or pairs)."
    )
    deterministic: bool = key(
        True, "Use deterministic torch algorithms so a resumed run reproduces bitwise on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = key(
        "auto", "Where the policy trains: auto picks cuda when available, else cpu."
    )


@attrs.frozen
class LoraConfig:
    rank: int = key(0, "LoRA rank r of the adapters; 0: full fine-tuning (no adapters).")
    alpha: float = key(16.0, "LoRA alpha: the adapters' update is scaled by alpha / rank.")
    dropout: float = key(0.0, "Dropout on the adapters' input (applied in training forwards).")
    target_modules: list[str] = key(
        [], "Names (suffixes) of the linear layers that get adapters, e.g. "
        "[\"q_proj\", \"v_proj\"]; empty: every linear layer except the LM head."
    )


@attrs.frozen
class ModelConfig:
    path: str = key(
        "builtin:tiny-arith",
        "A local Hugging Face model folder, or builtin:tiny-arith, builtin:tiny-arith-char, "
        "builtin:tiny-arith-teacher, builtin:tiny-arith-tools, builtin:tiny-code, "
        "builtin:smollm2-135m-instruct.",
    )
    model_type: str = key(
        "", "Overrides config.json's model_type when picking the built-in DataPacker."
    )
    trust_remote_code: bool = key(False, "Allow the model folder's own Python code to run.")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = key(
        "float32", "Parameter dtype of the policy (float32 on CPU; float64 for numerical checks)."
    )
    lora: LoraConfig = table(
        LoraConfig, "Train low-rank adapters (LoRA) instead of every weight: only the adapters "
        "train and are checkpointed; the rollout engine receives the merged weights."
    )


@attrs.frozen
class ValidationConfig:
    enabled: bool = key(True, "Evaluate on a held-out set and check it does not overlap training.")
    size: int = key(64, "Number of held-out items (built-in sources) or the cap on a given source.")
    factory: str = key(
        "", "Dotted path of a held-out dataset factory (same contract as data.factory)."
    )
    factory_kwargs: dict[str, Any] = key({}, "Keyword arguments for the held-out factory.")
    path: str = key("", "Local file or folder of the held-out set (jsonl/json/parquet/csv).")
    split: str = key("", "Split of the held-out file or hub dataset; empty: same as data.split.")
    jsonl_path: str = key("", "DPO: a jsonl file of held-out preference pairs.")


@attrs.frozen
class DataConfig:
    factory: str = key("", "Dotted path of a callable returning a map-style dataset.")
    factory_kwargs: dict[str, Any] = key({}, "Keyword arguments for data.factory (free-form).")
    path: str = key("", "A local jsonl/json/parquet/csv file or folder, read through datasets.")
    name: str = key("", "A datasets hub name (needs network or a local cache).")
    config: str = key("", "Configuration name of the hub dataset.")
    revision: str = key("", "Revision of the hub dataset; part of the cursor fingerprint.")
    split: str = key("train", "Split to read from data.path or data.name.")
    prompt_column: str = key("prompt", "Column holding the prompt.")
    response_column: str = key("", "Column holding the reference answer, if any.")
    messages_column: str = key(
        "", "SFT only: column holding each conversation as chat messages (OpenAI format: role, "
        "content, tool_calls; tool messages for tool results); instead of prompt_column and "
        "response_column (one user turn, one assistant turn)."
    )
    tools_column: str = key(
        "", "SFT with data.messages_column: column holding each conversation's tool schemas "
        "(OpenAI format: a list of {type: function, function: {name, description, "
        "parameters}}), rendered by the chat template with the conversation, as an agent's "
        "tools are; empty: no tools."
    )
    items_fn: str = key(
        "", "Dotted callable applied to each raw row (row in, row out) before columns are read."
    )
    shuffle: bool = key(True, "Shuffle the order each epoch (a pure function of seed and epoch).")
    cursor_resume: CursorResume = key(
        "auto",
        "strict: require a saved cursor with the same fingerprint; auto: resume it when present; "
        "off: continue the model without restoring the data position.",
    )
    count: int = key(2000, "Built-in arithmetic: number of training prompts.")
    min_operand: int = key(0, "Built-in arithmetic: smallest operand.")
    max_operand: int = key(20, "Built-in arithmetic: largest operand.")
    operators: list[str] = key(["+", "-"], "Built-in arithmetic: operators to draw from (+, -, *).")
    image_column: str = key(
        "", "PPO, GRPO, OPD and SFT: column holding each item's image(s) (paths, raw bytes or "
        "PIL images); a multimodal packer feeds them to the model. SFT: one per {type: image} "
        "part of the conversation's messages, or, with no such part, all at the start of its "
        "first user message."
    )
    video_column: str = key(
        "", "PPO, GRPO and OPD: column holding each item's video(s) (video files as paths or "
        "bytes, decoded with PyAV, or lists of frames)."
    )
    id_column: str = key("", "PPO only: column holding a stable item id.")
    metadata_columns: list[str] = key(
        [], "PPO only: allowlist of extra columns carried into the trajectory."
    )
    jsonl_path: str = key("", "DPO only: a jsonl file of (prompt, chosen, rejected) objects.")
    tar_path: str = key("", "DPO only: a tar archive of preference samples (read in memory).")
    tar_member_max_bytes: int = key(
        64 * 2**20, "DPO tar archives: most bytes read from one .json member; larger is refused."
    )
    tar_max_bytes: int = key(
        2 * 2**30, "DPO tar archives: most bytes of the whole archive once decompressed (every "
        "member, read or skipped, and what follows the end marker); a larger archive is "
        "refused as soon as it passes this, however small it is compressed."
    )
    synthetic_pairs: int = key(0, "DPO only: number of built-in arithmetic preference pairs.")
    synthetic_rejected: Literal["one_too_high", "near_miss"] = key(
        "one_too_high", "Built-in preference pairs: the rejected answer. one_too_high: the right "
        "answer + 1 (the slip builtin:tiny-arith makes); near_miss: the right answer -3..+3, "
        "never 0, the offset fixed per problem (no 'smaller is better' shortcut: a reward model "
        "must check the answer)."
    )
    chosen_key: str = key("", "DPO: key of the preferred answer; empty accepts chosen or winner.")
    rejected_key: str = key("", "DPO: key of the rejected answer; empty accepts rejected or loser.")
    margin_column: str = key(
        "", "RM only: key of each pair's margin m, a finite number every pair of a jsonl, tar or "
        "factory source (training and held-out) must carry; the loss becomes "
        "-log sigma(r_chosen - r_rejected - m). Empty: no margin (m = 0)."
    )
    validation: ValidationConfig = table(ValidationConfig, "The held-out set.")


@attrs.frozen
class DataPackerConfig:
    factory: str = key(
        "", "Dotted zero-argument callable returning the student's DataPacker; empty: by "
        "model_type."
    )
    teacher_model_factory: str = key(
        "", "OPD cross_token_multimodal only: DataPacker factory of the teacher model."
    )


@attrs.frozen
class RolloutConfig:
    engine: Literal["hf", "vllm"] = key(
        "hf", "hf: transformers generate in process; vllm: vllm.LLM."
    )
    max_new_tokens: int = key(16, "Most tokens generated per completion.")
    max_model_len: int = key(
        0, "Most tokens of a sequence in the engine, prompt and completion (at most the model's "
        "context, max_position_embeddings). 0: derived; vllm: max_new_tokens plus the longest "
        "prompt's tokens (measured before the run), rounded up to a multiple of 64, at most the "
        "model's context; hf: the model's context. A prompt that does not fit is refused, "
        "naming its row."
    )
    temperature: float = key(1.0, "Sampling temperature.")
    top_p: float = key(1.0, "Nucleus sampling threshold.")
    top_k: int = key(0, "Top-k sampling; 0 disables it.")
    batch_size: int = key(
        128, "hf engine: sequences (prompts x samples) per generate call; more run each decoding "
        "step's forward over more rows at once, fewer hold a smaller KV cache."
    )
    share_policy: bool = key(
        True, "hf engine: generate with the policy's own model instead of a copy of it when the "
        "policy trains in the engine's dtype without autocast (fp32: train.precision 'no', or "
        "'auto' where bf16 is not native), is neither sharded nor LoRA, and no rollout overlaps "
        "training (algo.max_off_policy_steps = 0): one model in memory and no weight copy after "
        "each step, the same completions. false: always a copy."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = key(
        "auto", "Weight dtype of the rollout engine. auto: the policy's compute dtype (bf16 "
        "under bf16 training, only where bf16 is native; else float32)."
    )
    gpu_memory_utilization: float = key(0.3, "vllm on GPU: fraction of GPU memory for the engine.")
    enable_sleep_mode: bool = key(False, "vllm on GPU: free engine memory between rollouts.")
    vllm_kv_cache_gb: float = key(1.0, "vllm on CPU: KV cache size in GiB.")
    producer_threads: int = key(
        0, "With algo.max_off_policy_steps >= 1: the torch threads the producer thread samples "
        "with; 0: as many as the training (torch's default). The training keeps its own."
    )
    server_batching: Literal["lockstep", "continuous"] = key(
        "lockstep", "env.agent: when the endpoint runs the engine on the agents' calls. "
        "lockstep: once every live episode of the batch has a call waiting or has ended, so the "
        "episodes do not depend on thread timing (a resumed run repeats them, 1 and 2 ranks "
        "play the same); continuous: as soon as any call waits (the calls that arrived while "
        "the engine ran go together into its next call), so an agent busy with its tools holds "
        "no other episode back, at the price of that determinism."
    )


@attrs.frozen
class EnvConfig:
    factory: str = key(
        "", "Dotted path of an environment factory, called as factory(**factory_kwargs) once per "
        "episode; its reset(item, seed) opens the conversation and step(messages) answers each "
        "assistant turn (runner.envs.EnvStep). Empty with env.tools: the built-in tool "
        "environment. Empty without tools: single-turn rollouts.")
    factory_kwargs: dict[str, Any] = key({}, "Keyword arguments for env.factory (free-form).")
    max_turns: int = key(4, "Most assistant turns per episode; an episode still going then is "
                         "truncated.")
    max_total_tokens: int = key(
        512, "Most tokens of an episode, prompt and every turn; an episode that reaches it ends, "
        "truncated.")
    tools: list[str] = key(
        [], "Dotted paths of plain Python callables offered to the model as tools (rendered into "
        "the chat template's tools from each signature and docstring); the runner answers the "
        "model's calls to them.")
    tool_timeout_s: float = key(
        5.0, "Seconds one tool call may take; a slower call becomes a tool message saying so. "
        "0: no limit; at most 604800 (a week).")
    step_timeout_s: float = key(
        60.0, "Seconds the environment's reset or step may take; a slower one ends the run, "
        "naming it, the item and the turn. 0: no limit; at most 604800 (a week).")
    agent: str = key(
        "", "Dotted path of an agent written against the OpenAI API, called once per episode as "
        "agent(item, client=openai.OpenAI(...), **agent_kwargs) with a client of the policy "
        "served on 127.0.0.1; it returns its reward (a number, a dict of named numbers, or "
        "None: the [reward] functions' alone). Instead of factory and tools.")
    agent_kwargs: dict[str, Any] = key({}, "Keyword arguments for env.agent (free-form).")
    concurrency: int = key(32, "env.agent: episodes played at a time.")
    episode_timeout_s: float = key(
        120.0, "env.agent: seconds one episode may take; a slower one ends (on_agent_error).")
    on_rewrite: Literal["refuse", "split"] = key(
        "refuse", "env.agent: a call that does not send back the conversation so far (a "
        "message edited, dropped or summarised, the tools changed, or a template that renders "
        "it otherwise): refuse it (409, the agent's error) or split the episode there: the call "
        "starts a new segment from its own prompt, trained in the same sample with its own "
        "positions and attention (nothing of the earlier segments seen), the episode's reward "
        "shared; env/rewrites counts them."
    )
    on_agent_error: Literal["zero", "fail"] = key(
        "fail", "env.agent: an agent that raises, returns something else than a reward, sends "
        "a rewritten history or runs out of time: the run stops naming it and the item (fail), "
        "or the episode's env reward is 0 and env/agent_error counts it (zero).")


@attrs.frozen
class RewardConfig:
    functions: list[str] = key(
        ["arithmetic_exact"],
        "Reward functions: built-in names (arithmetic_exact, format, math_verify, exact_match, "
        "code_tests, code_tests_all) or dotted "
        "callables (completions, items) -> list[float].",
    )
    weights: list[float] = key([], "One weight per function; empty: all 1.0.")
    timeout_s: float = key(
        60.0, "Seconds each reward function may take on one batch (they run concurrently, each "
        "in a worker thread); a slower one fails the step, naming it. 0: no limit; at most "
        "604800 (a week)."
    )
    isolation: Literal["", "thread", "process"] = key(
        "", "Where reward functions run: thread (in the trainer, each function on the whole "
        "batch in a worker thread) or process (a pool of worker processes the runner owns, one "
        "sample per task, each under sample_timeout_s and memory_mb, in a fresh temporary "
        "folder, with none of the trainer's environment variables). Empty: process when "
        "code_tests or code_tests_all is among the functions, else thread."
    )
    workers: int = key(0, "isolation = process: worker processes (0: one per CPU core).")
    sample_timeout_s: float = key(
        10.0, "isolation = process, and the code_tests rewards: seconds one sample may take; "
        "its worker (or program) is killed at the limit.")
    memory_mb: int = key(
        1024, "isolation = process, and the code_tests rewards: the address-space limit of one "
        "sample's process, in MiB.")
    on_error: Literal["zero", "fail"] = key(
        "zero", "isolation = process: a sample whose reward failed (raised, timed out, crashed "
        "its worker) scores 0 and is counted in reward/failed/NAME (zero), or stops the step "
        "with one line naming the function and the item (fail).")
    overlong_buffer_len: int = key(
        0, "DAPO's overlong shaping (GRPO, PPO): a completion of L tokens longer than "
        "rollout.max_new_tokens - overlong_buffer_len gets (max_new_tokens - buffer - L) / "
        "buffer x overlong_penalty added to its reward. 0: off."
    )
    overlong_penalty: float = key(
        1.0, "The penalty of a completion that fills rollout.max_new_tokens (>= 0)."
    )


@attrs.frozen
class TrainConfig:
    optimizer: Literal["adamw"] = key("adamw", "The optimizer.")
    lr: float = key(1e-5, "Peak learning rate.")
    weight_decay: float = key(0.0, "AdamW weight decay.")
    adam_beta1: float = key(0.9, "AdamW beta1.")
    adam_beta2: float = key(0.999, "AdamW beta2.")
    lr_schedule: Literal["constant", "linear", "cosine"] = key(
        "constant", "Shape of the learning rate after warm-up."
    )
    warmup_steps: int = key(0, "Linear warm-up steps.")
    grad_accum_steps: int = key(1, "Micro-batches accumulated per optimizer step.")
    max_tokens_per_microbatch: int = key(
        0, "Split each rank's rows of an optimizer step into micro-batches of "
        "at most this many tokens (a conversation's tokens; a pair's chosen and rejected "
        "sequences together; a prompt and its completion), "
        "packed best-fit decreasing; a longer row is a micro-batch of its own, never cut. The "
        "update is the same. 0: off (train.grad_accum_steps micro-batches of equal row counts)."
    )
    logprob_max_tokens_per_microbatch: int = key(
        0, "GRPO, PPO, OPD, DPO: run the scoring passes (behaviour, reference and teacher "
        "logprobs, critic values; no gradient) in micro-batches of at most this many tokens, "
        "packed like train.max_tokens_per_microbatch; the values are the same. 0: one pass "
        "over each rank's rows."
    )
    balance_ranks: bool = key(
        True, "Every algorithm with train.max_tokens_per_microbatch on several ranks: before each "
        "step's update the ranks exchange their rows and split every optimizer step's rows "
        "between them by tokens (a prompt's rows or a pair's answers together, largest first, "
        "each to "
        "the rank with the fewest), so every rank trains about as many tokens in about as many "
        "micro-batches; the update is the same. false: each rank trains the rows the data order "
        "gave it."
    )
    max_grad_norm: float = key(1.0, "Clip the gradient norm to this; 0 disables clipping.")
    precision: Literal["auto", "no", "bf16", "fp16"] = key(
        "no", "Mixed precision of the trained and frozen models' forwards (fp32 master weights "
        "and optimizer state; log-softmax and losses in fp32). auto: bf16 where bf16 matrix "
        "products are native (CUDA with bf16, a CPU with AVX-512 BF16 or AMX), else no."
    )
    sharding: Literal["none", "fsdp"] = key(
        "none", "How the policy is spread over the ranks. none: each rank holds a full copy "
        "(DDP); fsdp: FSDP2 per transformer block, parameters, gradients and optimizer state "
        "sharded over the ranks (checkpoints: a consolidated model folder, the optimizer state "
        "one safetensors file per rank)."
    )
    eval_every: int = key(10, "Evaluate on the held-out set every N steps (0: only start and end).")
    padding_free: bool = key(
        True, "Score and train without padding when the DataPacker allows it (can_pack): each "
        "shared prompt computed once with its completions after it, or sequences packed end to "
        "end, whichever computes the fewest positions (padded rows when neither saves any)."
    )
    disable_dropout: bool = key(
        True, "Set every dropout probability of the trained models to 0, so the logprobs the "
        "loss compares (old and new, policy and engine) differ by the update only."
    )
    gradient_checkpointing: bool = key(
        False, "Keep only each transformer layer's input in the trained models' forwards and "
        "recompute the layer in the backward pass (transformers' gradient checkpointing, the "
        "non-reentrant form): activation memory falls from every layer's to about one layer's, "
        "the update computes each layer's forward twice. The numbers are the same."
    )
    compile: bool = key(
        False, "Run the trained and frozen models' training and scoring forwards, and the hf "
        "engine's generation (text models), through torch.compile (dynamic shapes): fewer "
        "operations per step once "
        "compiled, for long runs; the first steps pay the compilation (tens of seconds on a CPU "
        "for a small model, minutes for a large one). Results differ from eager ones in the "
        "last float digits; a compiled run resumes bitwise."
    )


@attrs.frozen
class EvalConfig:
    max_new_tokens: int = key(
        0, "Most tokens generated per held-out completion; 0: rollout.max_new_tokens."
    )
    num_samples: int = key(
        1, "Completions per held-out prompt (more than 1 needs temperature > 0); rewards are "
        "averaged over them."
    )
    temperature: float = key(0.0, "Sampling temperature of held-out completions; 0: greedy.")
    pass_at: list[int] = key(
        [], "With num_samples > 1: the k of every pass@k reported (unbiased estimate over the "
        "num_samples completions of each prompt), each in 1..num_samples; empty: 1 and "
        "num_samples."
    )
    pass_reward: str = key(
        "", "The reward function (a name in reward.functions) whose value decides whether a "
        "completion passes, for pass@k and majority voting; empty: the only function, else the "
        "first built-in exact-match one (arithmetic_exact, exact_match, math_verify)."
    )
    pass_threshold: float = key(1.0, "A completion passes when pass_reward's value is at least "
                                "this.")


@attrs.frozen
class CheckpointConfig:
    every_steps: int = key(25, "Write a checkpoint every N steps (and always at the end).")
    keep_last: int = key(2, "Keep this many checkpoints; older ones are deleted.")
    resume: Literal["auto", "never"] = key(
        "auto", "auto: continue from the latest complete checkpoint in run.output_dir."
    )


@attrs.frozen
class LaunchConfig:
    backend: Literal["local", "torchrun", "ray"] = key(
        "local", "local: every role in one process; torchrun: num_processes policy ranks on this "
        "machine (started by posttrain-run, or by an external torchrun / accelerate launch, "
        "detected from the environment); ray: num_processes policy ranks as Ray actors in one "
        "placement group, on a local or an existing Ray cluster (the ray extra)."
    )
    num_processes: int = key(1, "Policy ranks (torchrun / ray); must divide the items per step.")
    ray_address: str = key(
        "", "ray: address of a running Ray cluster ('127.0.0.1:6379', or 'auto' for the one "
        "this machine belongs to); empty starts a local single-node cluster on 127.0.0.1 only "
        "and stops it at the end.")
    ray_runtime_env: dict[str, Any] = key(
        {}, "ray: Ray runtime_env of every actor (free-form), e.g. { working_dir = '.' } or "
        "{ py_modules = ['my_ext'] } so a remote cluster's actors import the recipe's extension "
        "modules. Empty: the actors use the driver's working directory and PYTHONPATH (a "
        "cluster on this machine).")
    cpus_per_rank: float = key(1.0, "ray: CPUs reserved for each policy rank's actor.")
    gpus_per_rank: float = key(0.0, "ray: GPUs reserved for each policy rank's actor.")
    placement: Literal["colocated", "separate"] = key(
        "colocated", "ray: colocated: each rank owns its rollout engine, reference and teacher "
        "(as under torchrun); separate: the rollout engine runs in launch.rollout_actors actors "
        "of its own (rank 0 sends them the policy's weights through Ray's object store after "
        "every update), the frozen reference or OPD teacher in one more, each reward model "
        "(reward.functions = [\"model:PATH\"]) in one more; the ranks call them.")
    rollout_actors: int = key(
        1, "ray, placement = 'separate': rollout actors; rank r uses actor r % rollout_actors.")
    cpus_per_role_actor: float = key(
        1.0, "ray, placement = 'separate': CPUs of each role actor (rollout, reference, teacher, "
        "reward model).")
    gpus_per_role_actor: float = key(
        0.0, "ray, placement = 'separate': GPUs of each role actor (rollout, reference, teacher, "
        "reward model).")
    collective_timeout_s: float = key(
        300.0, "Upper bound in seconds of every collective between ranks and of every call to a "
        "role's actor (a dead rank or actor ends the run instead of hanging it). At most 604800 "
        "(a week).")


@attrs.frozen
class LoggingConfig:
    every_steps: int = key(1, "Write metrics every N steps.")
    report_to: list[Tracker] = key(
        ["jsonl"], "Where metrics rows go (rank 0 only): jsonl (metrics.jsonl, always written), "
        "tensorboard, wandb, mlflow. W&B runs offline unless WANDB_MODE says otherwise; MLflow "
        "writes a local store under the run folder unless MLFLOW_TRACKING_URI is set.")
    project: str = key(
        "posttrain-runner", "The W&B project and the MLflow experiment of the run (the tracker "
        "run is named run.name).")
    tensorboard: bool = key(
        False, "Deprecated: true is the same as listing \"tensorboard\" in logging.report_to.")
    sample_every: int = key(10, "Show a sample prompt and completion every N steps (0: never).")
    item_ids: bool = key(False, "Log the global ids of every step's items (metrics key "
                         "data/item_ids): which data each step trained on, on any number of ranks.")


@attrs.frozen
class Recipe:
    run: RunConfig = table(RunConfig, "Name, output folder, seed and length of the run.")
    model: ModelConfig = table(ModelConfig, "The policy model.")
    data: DataConfig = table(DataConfig, "Where prompts (or preference pairs) come from.")
    data_packer: DataPackerConfig = table(DataPackerConfig, "How items become model inputs.")
    algo: AlgoConfig = attrs.field(
        factory=GRPOConfig, metadata={"help": "The algorithm, tagged by kind."}
    )
    rollout: RolloutConfig = table(RolloutConfig, "The rollout engine and sampling.")
    env: EnvConfig = table(
        EnvConfig, "Multi-turn episodes (GRPO, PPO, OPD): an environment and/or tools answer the "
        "model's turns; without factory and tools, rollouts are single-turn.")
    reward: RewardConfig = table(RewardConfig, "Reward functions (GRPO, PPO).")
    train: TrainConfig = table(TrainConfig, "Optimizer and evaluation.")
    eval: EvalConfig = table(
        EvalConfig, "Held-out generation (scored with the reward functions); the defaults are "
        "greedy, one completion per prompt."
    )
    checkpoint: CheckpointConfig = table(CheckpointConfig, "Checkpoints and resume.")
    launch: LaunchConfig = table(LaunchConfig, "Where the roles run.")
    logging: LoggingConfig = table(LoggingConfig, "Metrics and the live view.")


# Keys whose tables are free-form: any sub-key is accepted (no "+" prefix needed in overrides).
FREEFORM_KEYS = frozenset({"data.factory_kwargs", "data.validation.factory_kwargs",
                           "env.factory_kwargs", "env.agent_kwargs",
                           "launch.ray_runtime_env"})
