"""Config -> components, in one place: the model directory, the prompts, the round
policy, the reward scorer, the rollout engine and the trainer. `rpk.run` hands them to
`rpk.controller`, which never calls back here; the benchmarks build the same pieces
through these functions.

The config is read where the pieces are put together (`assemble` and `start_parts`,
`plan_parts`, and `rpk.assembly.box`, where the memory plan meets it); every builder
takes its own section, the settings record `rpk.assembly.settings` makes of it, or the
`PartsPlan`'s records, as torchtitan hands each component its own config. In the order
a run takes them:
- `settings`: config -> the parts' records (the controller's, the trainer's, the
  reward stack's, the judge's, validation's, where the prompts come from);
- `inputs`: the cheap checks and what the run is made from (placement, model, prompts,
  tools, the agent's parts);
- `box`: this machine's GPU box, where the memory plan meets the config (and
  `dry_run`, the CLI's account of what a run would start);
- `parts`: the policy, the scorer, the fleet, the trainer and the streaming, and
  `plan_parts`, what the started parts are made from, worked out once;
- `start`: the slow starts (the judge, vLLM beside the trainer's load), and `assemble`,
  the whole way from a config to the run's `Components`.
"""

from rpk.assembly.box import box_for
from rpk.assembly.inputs import (
    AgentSetup,
    Placement,
    agent_tools,
    build_agent,
    builtin_rows,
    check_engine_nodes,
    code_sandbox,
    load_prompts,
    load_val_prompts,
    model_config_dir,
    place,
    resolve_model,
    tool_schemas,
)
from rpk.assembly.parts import (
    FleetStart,
    PartsPlan,
    TrainerPlan,
    build_round_policy,
    build_scorer,
    build_streaming,
    build_trainer,
    check_lengths,
    make_torch_trainer,
    model_context_length,
    plan_parts,
    start_engine,
    start_node_host,
    trainer_plan,
)
from rpk.assembly.settings import (
    PartsSettings,
    PromptSource,
    ToolTiming,
    eval_spec,
    judge_settings,
    parts_settings,
    prompt_source,
    run_judge_settings,
    task_tool_latency,
    tool_timing,
    uses_task_tools,
)
from rpk.assembly.start import assemble, start_parts
from rpk.controller import Components

__all__ = [
    "AgentSetup", "Components", "FleetStart", "PartsPlan", "PartsSettings", "Placement", "PromptSource",
    "ToolTiming",
    "TrainerPlan",
    "agent_tools", "assemble", "box_for", "build_agent", "build_round_policy", "build_scorer",
    "build_streaming", "build_trainer", "builtin_rows", "check_engine_nodes", "check_lengths",
    "code_sandbox", "eval_spec", "judge_settings", "load_prompts", "load_val_prompts", "make_torch_trainer",
    "model_config_dir", "model_context_length", "parts_settings", "place", "plan_parts", "prompt_source",
    "resolve_model",
    "run_judge_settings", "start_engine", "start_node_host", "start_parts", "task_tool_latency",
    "tool_schemas", "tool_timing", "trainer_plan", "uses_task_tools",
]
