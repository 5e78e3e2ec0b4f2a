"""What every benchmark shares: its command line (`--out`, config overrides after `--`),
running its variants (short `rpk.run`s in throwaway run directories, or the real loop on
the simulator), the table it prints and the JSON result file."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpk.core.records import Response, Scored

if TYPE_CHECKING:
    import torch

# A benchmark's runs write no checkpoints and no progress bar.
QUIET = ("--run.checkpoint_every", "0", "--run.progress", "false")


def parser(doc: str | None, out_help: str = "write the result as JSON here") -> argparse.ArgumentParser:
    """A benchmark's argument parser: its docstring as the help, and `--out`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, help=out_help)
    return ap


def add_sampling_args(ap: argparse.ArgumentParser, steps: int, steps_help: str | None, prompts: int,
                      p0: int = 128) -> None:
    """A simulated run's size: its steps, the prompts of an epoch, P0 prompts x R0
    responses a step, and tail batching's eta."""
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--prompts", type=int, default=prompts, help="one epoch")
    ap.add_argument("--p0", type=int, default=p0)
    ap.add_argument("--r0", type=int, default=8)
    ap.add_argument("--eta", type=float, default=1.25, help="tail's eta for prompts and responses")


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's own arguments, rpk config overrides given after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as JSON values (paths as strings), for the result file."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: Path | None, result: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def run_phases(argv: Sequence[str]) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """`python -m rpk.run argv`, quiet, with its run directory in a temporary folder: its
    exit code, step records and validation records (none when it failed; it has said
    why)."""
    from rpk import run
    from rpk.obs.metrics import read_records

    with tempfile.TemporaryDirectory() as tmp:
        code = run.main([*QUIET, *argv, "--run.out_dir", tmp])
        if code != 0:
            return code, [], []
        metrics = Path(tmp) / "latest" / "metrics.jsonl"
        return code, read_records(metrics), read_records(metrics, "eval")


def run_steps(argv: Sequence[str]) -> tuple[int, list[dict[str, Any]]]:
    """`run_phases` without the validation records."""
    code, records, _ = run_phases(argv)
    return code, records


Summarize = Callable[[str, Sequence[Mapping[str, Any]]], dict[str, Any]]


def run_variants(
    variants: Mapping[str, Sequence[str]], steps: int, summarize: Summarize,
    common: Sequence[str] = (), passthrough: Sequence[str] = (),
) -> tuple[int, list[dict[str, Any]]]:
    """Each variant one `run_steps` of `steps` steps, in order, on the config overrides
    `common`, then the variant's own, then `passthrough` (the last word): the first
    failing exit code (0 when none failed) and a row per variant run, `summarize(name,
    records)`."""
    rows = []
    for name, argv in variants.items():
        print(f"== {name}: {steps} steps", flush=True)
        code, records = run_steps([*common, *argv, "--run.steps", str(steps), *passthrough])
        if code != 0:
            return code, rows
        rows.append(summarize(name, records))
    return 0, rows


class FixedScorer:
    """Reward 1 for every response: the sim has no text to check, and no policy may
    pick prompts by reward."""

    async def score(self, response: Response) -> Scored:
        return Scored(response, 1.0, True)

    async def aclose(self) -> None:
        return None


def mean_centred(rewards: Sequence[float]) -> list[float]:
    return [x - sum(rewards) / len(rewards) for x in rewards]


def measured(outcomes: Sequence[Any]) -> Sequence[Any]:
    """The steps a bench reports: past the first (it compiles and warms up) when there are more."""
    return outcomes[1:] if len(outcomes) > 1 else outcomes


def reward_step_medians(outcomes: Sequence[Any], suffix: str = "") -> dict[str, Any]:
    """The per-step medians the reward benches report (`bench.judge`, `bench.reward_overlap`),
    each key ending in `suffix`: the step, its rollout and generation, the reward's exposed
    and busy time, and the responses scored."""
    steps = measured(outcomes)

    def med(values: Any) -> float:
        return statistics.median(list(values))

    return {"measured_steps": len(steps), **{f"{k}{suffix}": v for k, v in {
        "step_s": med(o.time_step_s for o in steps),
        "rollout_s": med(o.time_rollout_s for o in steps),
        "generation_s": med(o.round.last_response_at - o.round.started_at for o in steps),
        "reward_exposed_s": med(o.round.reward_exposed_s for o in steps),
        "reward_busy_s": med(o.round.reward_busy_s for o in steps),
        "responses": med(sum(len(g.members) for g in o.round.groups) for o in steps),
    }.items()}}


async def sim_steps(
    steps: int, policy: Any, engine: Any, trainer: Any, record: Callable[[Any], dict[str, Any]],
    **options: Any,
) -> list[dict[str, Any]]:
    """Steps 1..`steps` of the real loop (`run_step`) on a simulated engine or fleet and
    its virtual clock, every response rewarded 1, advantages centred on the group's
    mean; `options` go to `run_step`. One `record(outcome)` per step. Closes the
    trainer and the engine."""
    from rpk.loop.step import run_step

    scorer = FixedScorer()
    records = []
    try:
        for step in range(1, steps + 1):
            o = await run_step(step, policy, engine, scorer, trainer, mean_centred,
                               version=trainer.version, clock=engine.clock, **options)
            records.append(record(o))
    finally:
        await trainer.aclose()
        await engine.shutdown()
    return records


@dataclass(frozen=True, slots=True)
class Col:
    """A column of a printed table: its header, the row's key, its width and the cell's
    format spec, a unit after the number. A cell whose value is None prints `-`. The spec
    `<` left-aligns header and cells; a left-aligned column after the first is set off
    by two spaces."""

    head: str
    key: str
    width: int
    spec: str = ""
    unit: str = ""


def _fit(text: str, col: Col, first: bool) -> str:
    if not col.spec.startswith("<"):
        return text.rjust(col.width)
    return text.ljust(col.width) if first else "  " + text.ljust(col.width)


def table_header(cols: Sequence[Col]) -> str:
    return "".join(_fit(c.head, c, i == 0) for i, c in enumerate(cols))


def table_line(row: Mapping[str, Any], cols: Sequence[Col]) -> str:
    cells = ("-" if row[c.key] is None else format(row[c.key], c.spec) + c.unit for c in cols)
    return "".join(_fit(text, c, i == 0) for i, (text, c) in enumerate(zip(cells, cols)))


def print_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[Col]) -> None:
    print(table_header(cols))
    for row in rows:
        print(table_line(row, cols))


# -- model weights, for the weight-path benches (weight_transfer, node_transfer, lora) --

SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (128, 4, 4, 2, 384, 259),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),
}
BUCKET_BYTES = 256 * 2**20  # rollout.weight_bucket_mb's default


def qwen2_weights(shape: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights of a tied Qwen2 of `shape` (lm_head omitted: tied)."""
    import torch

    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    head_dim, gen = hidden // heads, torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden), p + "self_attn.k_proj.bias": (kv * head_dim,),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden), p + "self_attn.v_proj.bias": (kv * head_dim,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}


def shared(weights: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A copy of `weights` in shared memory, as a trainer's parameters are on `cpu_ipc`,
    and the module whose life the file's follows."""
    import torch

    from rpk.sync.cpu_ipc import share_weights

    holder = torch.nn.Module()
    for i, t in enumerate(weights.values()):
        holder.register_parameter(f"w{i}", torch.nn.Parameter(t.clone(), requires_grad=False))
    if share_weights(holder) is None:
        raise SystemExit("cpu_ipc: /dev/shm has no room for the weights")
    return holder, dict(zip(weights, holder.parameters()))


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def bucket_list(weights: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    from rpk.train.weights import bucketed

    return list(bucketed(weights.items(), BUCKET_BYTES))


async def abuckets(buckets: list[list[tuple[str, torch.Tensor]]]) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
    for b in buckets:
        yield b


def read_files(paths: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files `paths`, by name."""
    from safetensors import safe_open

    out = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def model_dir(shape: str, tokenizer_from: Path, into: Path) -> Path:
    """A Qwen2 model directory of `shape` (random weights, the tiny model's tokenizer)."""
    import json
    import shutil

    from safetensors.torch import save_file

    config = json.loads((tokenizer_from / "config.json").read_text())
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                  layer_types=["full_attention"] * layers, tie_word_embeddings=True)
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, into / name)
    save_file(qwen2_weights(shape, seed=1), str(into / "model.safetensors"))
    return into


def tiny_dir() -> Path:
    """A built tiny model's directory in the default cache (its tokenizer and config)."""
    from rpk.config import ModelConfig

    found = sorted(Path(ModelConfig().cache_dir).glob("tiny-*/config.json"))
    if not found:
        raise SystemExit("--engine needs a built tiny model (run `python -m rpk.run` once) "
                         "or --tokenizer-from DIR")
    return found[0].parent


def random_qwen2(directory: Path, hidden: int = 256, layers: int = 4, vocab: int = 4096) -> Path:
    """A randomly initialised Qwen2 (8 heads, 2 KV heads) with a word-level tokenizer, saved
    in `directory`: what the GPU checks train and serve, where only the shapes matter."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, intermediate_size=4 * hidden,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(directory)
    return directory
