"""What a user watches: a live rich display of the step in progress, a line per finished
step, and a summary table at the end."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rpk.core.outcomes import RoundPlan
from rpk.core.records import Group
from rpk.obs.metrics import step_failures


class LiveProgress:
    """A StepObserver that drives rich progress bars; cheap enough for the event loop
    (rich refreshes on its own thread)."""

    def __init__(self, total_steps: int, console: Console | None = None, live: bool = True):
        # soft_wrap: a step line stays one line in logs, where rich assumes 80 columns.
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.total_steps = total_steps
        self._progress = Progress(
            TextColumn("[bold]{task.description:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=not live,
        )
        self._rollout = self._progress.add_task("rollout", total=1, info="", visible=False)
        self._train = self._progress.add_task("train", total=1, info="", visible=False)
        self._tokens = 0
        self._groups = 0

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def round_started(self, plan: RoundPlan) -> None:
        self._tokens = 0
        self._groups = 0
        total = len(plan.prompts) * plan.responses_per_prompt
        self._progress.reset(
            self._rollout,
            total=total,
            visible=True,
            description=f"step {plan.step}",
            info=f"{plan.kind.value} round",
        )
        self._progress.reset(self._train, total=1, visible=False)

    def response_finished(self, tokens: int) -> None:
        self._tokens += tokens
        self._progress.update(self._rollout, advance=1, info=self._info())

    def group_completed(self, group: Group) -> None:
        self._groups += 1
        self._progress.update(self._rollout, info=self._info())

    def _info(self) -> str:
        return f"{self._groups} groups, {self._tokens} tokens"

    def training(self, done_samples: int, total_samples: int) -> None:
        self._progress.update(
            self._train, total=total_samples, completed=done_samples, visible=True, info=""
        )

    def step_done(self, record: Mapping[str, Any]) -> None:
        r = record
        line = (
            f"step {r['step']:>4}/{self.total_steps}  reward {r['reward_mean']:.3f}  "
            f"acc {r['accuracy']:.3f}  len p50/max {r['response_len_p50']:.0f}/"
            f"{r['response_len_max']}  rollout {r['time_rollout_s']:.1f}s  "
            f"train {r['time_train_s']:.1f}s  sync {r['time_sync_s']:.2f}s  "
            f"{r['tokens_per_s']:.0f} tok/s"
        )
        line += judge_part(r)
        if r.get("reward_failed"):
            kinds = ", ".join(f"{kind} {n}" for kind, n in step_failures(r).items())
            line += (
                f"  [bold red]reward failed {r['reward_failed']}/{r['reward_scored']}"
                f" ({kinds})[/bold red]"
            )
        self.console.print(line)

    def sample(self, row: Mapping[str, Any]) -> None:
        """One sampled response (a row of samples.jsonl), as the model wrote it."""
        self.console.print(
            f"  sample ({row['round_kind']} round, {row['tokens']} tokens, reward "
            f"{row['reward']:.3f}):", style="dim",
        )
        self.console.print(f"{row['prompt']}{row['response']}", markup=False, highlight=False)

    def validated(self, record: Mapping[str, Any]) -> None:
        """One line per validation pass (`rpk.obs.validation.val_record`)."""
        r = record
        if "val/acc_greedy" not in r:
            return
        sampled = "".join(
            f"  {k[4:]} {v:.3f}" for k, v in r.items()
            if k.startswith(("val/mean@", "val/pass@")) and not k.endswith("_se")
        )
        self.console.print(
            f"val  after step {r['step']:>4}  greedy {r['val/acc_greedy']:.3f} "
            f"± {r['val/acc_greedy_se']:.3f}{sampled}  len {r['val/len_greedy']:.0f}  "
            f"({r['val/prompts']:.0f} prompts, {r['time_eval_s']:.1f}s)"
        )

    def message(self, text: str) -> None:
        self.console.print(text)


def judge_part(record: Mapping[str, Any]) -> str:
    """The step line's judge figures, where the step measured the judge: its
    false-positive rate against the rule (fp of the rule's no's) and its canaries'
    (`rpk.reward.canary`), the alarm when it is up."""
    r = record
    out = ""
    if "reward_judge_fp_rate" in r:
        fp, no = r["reward_judge_rule_fp"], r["reward_judge_rule_fp"] + r["reward_judge_rule_tn"]
        out += f"  judge fp {r['reward_judge_fp_rate']:.2f} ({fp}/{no})"
    if r.get("reward_judge_canary_asked"):
        out += f"  canary fp {r['reward_judge_canary_fp']}/{r['reward_judge_canary_answered']}"
    if r.get("reward_judge_canary_alarm"):
        out += "  [bold red]canary alarm[/bold red]"
    return out


def summary_table(summary: Mapping[str, float], run_dir: str) -> Table:
    table = Table(title=f"rpk run summary ({run_dir})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    return table
