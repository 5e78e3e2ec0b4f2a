"""The tiny model for the multi-turn task (`rpk.tasks.tool_add`).

Built like the arith model (`rpk.tasks.tiny`: same architecture, same chat template,
same cache) by another recipe: the tokenizer learns the trajectories' text (tool calls,
results, answers) and the warm-up trains on reference trajectories, rendered token for
token as an agent rollout lays them out:

    prompt (chat template, generation prompt)                           mask 0
    assistant turn (its text) + <|im_end|>                               mask 1
    observation: `\\n<|im_start|>tool\\n{result}<|im_end|>\\n<|im_start|>assistant\\n`  mask 0
    ... more turns and observations ...
    final assistant turn + <|im_end|>                                    mask 1

Each observation is the template's suffix after the assistant turn's `<|im_end|>`,
encoded once, which is what rpk's agent rollout feeds the model between turns; so the
model warms up on exactly the token sequences it will continue in RL. The loss is on the
assistant's tokens only: observations are given, not written.

Some answers carry one wrong digit (`TinySpec.sft_slip`, as arith's warm-up does) and
some calls fail and are made again (the adder's own 5%), so RL starts from a policy that
calls well, is right on part of the problems (mostly the short ones) and can improve.

Slips alone leave greedy decoding nothing to learn: the warm-up answers every one-call
sum right when no call fails, and RL only sharpens sampling. So the multi-call
trajectories carry a habit (`TinySpec.sft_habit`), an agent's mistake: that share of
them answer before their last call, with the partial sum they have. Greedy then stops
one call short, sampling makes the last call often enough for the reward to teach it,
and every answer is still a copy of the last result. The habit must not contradict
that copy: the tiny model shares one copying mechanism across positions, and a habit
that does (arith's units digit one too high, a carry passed on as 0) breaks copying
everywhere, leaving RL nothing to reward. The runs behind these choices are in
docs/multi-turn.md ("What the built-in task learns") and docs/default-run.md.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Sequence
from typing import Any

from rpk.tasks import tool_add
from rpk.tasks.arith import make_problem
from rpk.tasks.specs import TinySpec
from rpk.tasks.tiny import Example, Recipe, check_fits

# Bump whenever a change here (or in tool_add's text) alters what a build produces.
CODE_VERSION = 5

_TOKENIZER_PROBLEMS = 300
# Each result label (`sD`) must be one token for the answer to copy by a one-token match
# (see tool_add's docstring). The long columns' labels are too rare in the trajectories
# to win a merge, so every label is shown this many times on its own.
_LABEL_REPEATS = 200


def _messages(rng: random.Random, spec: TinySpec, alpha: float | None,
              habits: random.Random | None = None) -> list[dict[str, str]]:
    """A reference trajectory; with `habits`, stopped one call short at the habit's rate
    (on sums of `spec.sft_habit_digits`)."""
    task = spec.task if alpha is None else dataclasses.replace(spec.task, alpha=alpha)
    problem = make_problem(rng, task)
    lo, hi = spec.sft_habit_digits
    early = habits is not None and lo <= problem.digits <= hi and habits.random() < spec.sft_habit
    return tool_add.reference_messages(problem, rng.randrange(2**31), stop_early=early)


def corpus(spec: TinySpec) -> list[str]:
    """Text the tokenizer learns from: role names, the results' labels (`sA sB ...`)
    and whole reference trajectories, failures included (a higher failure rate, so
    their words are learnt too)."""
    rng = random.Random(f"tool-add-tokenizer-{spec.seed}")
    texts = ["system", "user", "assistant", "tool"]
    columns = string.ascii_uppercase[: spec.task.max_digits]
    labels = " ".join(tool_add.SUM_MARK + label for label in columns)
    texts += [labels] * _LABEL_REPEATS
    for _ in range(_TOKENIZER_PROBLEMS):
        problem = make_problem(rng, spec.task)
        texts += [m["content"] for m in tool_add.reference_messages(problem, rng.randrange(2**31), 0.2)]
    return texts


def observation_text(tokenizer: Any, messages: Sequence[dict[str, str]], upto: int) -> str:
    """The text between the end (`<|im_end|>`) of the assistant turn `messages[upto-1]`
    and the start of the next assistant turn, when `messages[upto:]` up to that turn
    are observations: the template renders with and without them and the difference is
    the observation. ValueError when the template is not append-only there."""
    before = tokenizer.apply_chat_template(list(messages[:upto]), tokenize=False)
    end = before.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)
    nxt = upto
    while nxt < len(messages) and messages[nxt]["role"] != "assistant":
        nxt += 1
    after = tokenizer.apply_chat_template(
        list(messages[:nxt]), tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before[:end]):
        raise ValueError("the chat template is not append-only over tool messages")
    return after[end:]


def encode_trajectory(tokenizer: Any, messages: Sequence[dict[str, str]]) -> Example:
    """(ids, loss mask) of one trajectory, laid out as an agent rollout lays it out
    (see the module docstring): each assistant turn's text tokenised on its own and
    closed by EOS (mask 1), the prompt and each observation encoded once (mask 0)."""
    if not messages or messages[0]["role"] != "user":
        raise ValueError("a trajectory starts with the user's question")
    prompt = tokenizer.apply_chat_template(
        [messages[0]], tokenize=False, add_generation_prompt=True
    )
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    mask = [0] * len(ids)
    i = 1
    while i < len(messages):
        message = messages[i]
        if message["role"] == "assistant":
            turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            turn = list(turn) + [tokenizer.eos_token_id]
            ids += turn
            mask += [1] * len(turn)
            i += 1
            continue
        observed = tokenizer(observation_text(tokenizer, messages, i), add_special_tokens=False)
        ids += observed["input_ids"]
        mask += [0] * len(observed["input_ids"])
        while i < len(messages) and messages[i]["role"] != "assistant":
            i += 1
    if messages[-1]["role"] != "assistant":
        raise ValueError("a trajectory ends on the assistant's answer")
    return ids, mask


def _slip(messages: list[dict[str, str]], rate: float, rng: random.Random) -> list[dict[str, str]]:
    """With probability `rate`, one digit of the final answer wrong (see
    `rpk.tasks.tiny._maybe_slip` for why)."""
    if rng.random() >= rate:
        return messages
    answer = messages[-1]["content"]
    pos = rng.choice([i for i, ch in enumerate(answer) if ch.isdigit()])
    wrong = str((int(answer[pos]) + rng.randint(1, 9)) % 10)
    return [*messages[:-1], {"role": "assistant", "content": answer[:pos] + wrong + answer[pos + 1 :]}]


def examples(tokenizer: Any, spec: TinySpec) -> list[Example]:
    """The warm-up set: `spec.sft_problems` reference trajectories (digit counts drawn
    with `spec.sft_alpha`), some answers slipped, most multi-call ones one call short."""
    rng = random.Random(f"tool-add-sft-{spec.seed}")
    slips = random.Random(f"tool-add-slip-{spec.seed}")
    habits = random.Random(f"tool-add-habit-{spec.seed}")
    out = [
        encode_trajectory(tokenizer, _slip(_messages(rng, spec, spec.sft_alpha, habits), spec.sft_slip, slips))
        for _ in range(spec.sft_problems)
    ]
    check_fits(out, spec)
    return out


# One build thread: see `Recipe.threads` (the shared 2-core machine).
TOOL_ADD = Recipe("tool_add", CODE_VERSION, corpus, examples, threads=1)

