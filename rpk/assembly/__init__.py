"""Config -> components, in one place: the model directory, the prompts, the round
policy, the reward scorer, the rollout engine and the trainer. `rpk.run` hands them to
`rpk.controller`, which never calls back here; the benchmarks build the same pieces
through these functions.

Each builder takes the whole `Config` and reads its own sections; besides them only
`rpk.assembly.settings` (the records of the parts that take no config) copies config
fields. In the order a run takes them:
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
    AgentSetup, Placement, agent_tools, build_agent, builtin_rows, check_engine_nodes, code_sandbox,
    eval_spec, load_prompts, load_val_prompts, model_config_dir, place, resolve_model, tiny_spec,
    tool_schemas,
)
from rpk.assembly.parts import (
    PartsPlan, build_round_policy, build_scorer, build_streaming, build_trainer, check_lengths,
    make_torch_trainer, model_context_length, plan_parts, start_engine, start_node_host,
)
from rpk.assembly.start import assemble, start_parts
from rpk.controller import Components

__all__ = [
    "AgentSetup", "Components", "PartsPlan", "Placement", "agent_tools", "assemble", "box_for",
    "build_agent", "build_round_policy", "build_scorer", "build_streaming", "build_trainer",
    "builtin_rows", "check_engine_nodes", "check_lengths", "code_sandbox", "eval_spec",
    "load_prompts", "load_val_prompts", "make_torch_trainer", "model_config_dir",
    "model_context_length", "place", "plan_parts", "resolve_model", "start_engine", "start_parts",
    "start_node_host", "tiny_spec", "tool_schemas",
]
