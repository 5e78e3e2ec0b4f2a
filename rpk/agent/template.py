"""Observations as token ids, encoded once with the model's own chat template.

A trajectory's context is the prompt's ids, then every token the model sampled, as
sampled, then each observation's ids, then the next turn's samples, and so on. It is
never decoded and re-tokenized: decode/encode is not a bijection (TRL#5224, SkyRL#123,
verl's "not even converged"), and a drifted token makes its log-prob and PPO ratio wrong.

So an observation is encoded as the template's suffix after an assistant turn: render a
probe conversation `[user, assistant(PROBE), *observation]` with the generation prompt,
and take the text after the assistant turn's end-of-turn token (`<|im_end|>`). The model
sampled that token itself (it is in the loss); what follows it (the template's `\n`,
then `<|im_start|>tool\n...<|im_end|>\n<|im_start|>assistant\n`) is the observation, out
of the loss. Losing that `\n` is verl#3720/#6501. All of a step's observation messages
are rendered together, so a template that merges consecutive tool results into one turn
(Qwen2.5's `<tool_response>` blocks) does so (slime#2263).

The encoder needs two things of a template, and checks both once, at construction,
failing in one line that names the template: it keeps an assistant turn's text when a
tool message follows it (one that drops it, as some drop earlier `<think>` blocks, has
no place to append to), and it renders an observation the same whatever came before
(so the suffix of a probe conversation is the suffix of the real one). Templates that
render the last assistant turn differently from earlier ones (Qwen3's thinking blocks)
pass: the sampled tokens are never re-rendered. The tokenizer is passed in: this module
imports no model code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Two different probe conversations: an observation's encoding must not depend on them.
_PROBES = (("rpk-probe-question", "rpk-probe-answer"), ("Another question?", "Another answer."))
_PROBE_OBSERVATION = ({"role": "tool", "name": "probe", "content": "rpk-probe-result"},)


class TemplateError(ValueError):
    """A chat template the encoder cannot take observations from; names the template."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """An observation: its token ids (encoded once) and their text, for logs and reward."""

    token_ids: tuple[int, ...]
    text: str


class ObservationEncoder:
    """Encodes a step's observation messages as the tokens that follow the model's turn.

    `end_of_turn`: the string the model's turn ends on (default: the tokenizer's EOS);
    `tools`: the OpenAI tool schemas, passed to templates that render them."""

    def __init__(
        self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] = (), name: str = "",
        end_of_turn: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] or None
        self.name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.end_of_turn = end_of_turn or tokenizer.eos_token
        if not self.end_of_turn:
            raise TemplateError(f"tokenizer {self.name!r} has no EOS token to end a turn on")
        ids = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self.end_of_turn_id: int | None = ids if isinstance(ids, int) else None
        one = self._suffix(_PROBE_OBSERVATION, _PROBES[0])
        if one != self._suffix(_PROBE_OBSERVATION, _PROBES[1]):
            raise TemplateError(
                f"the chat template of {self.name!r} renders a tool message differently "
                "depending on the conversation before it, so an observation cannot be "
                "encoded once and appended to the sampled tokens"
            )

    def _suffix(self, observation: Sequence[Mapping[str, Any]], probe: tuple[str, str] = _PROBES[0]) -> str:
        """What the template renders from the probe turn's end-of-turn token on, through
        the next assistant turn's opening."""
        question, answer = probe
        messages = [
            {"role": "user", "content": question}, {"role": "assistant", "content": answer},
            *[dict(m) for m in observation],
        ]
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if self.tools:
            kwargs["tools"] = self.tools
        full = self.tokenizer.apply_chat_template(messages, **kwargs)
        at = full.find(answer)
        cut = full.find(self.end_of_turn, at + len(answer)) if at >= 0 else -1
        if at < 0 or full[at + len(answer) : cut].strip() or cut < 0:
            raise TemplateError(
                f"the chat template of {self.name!r} does not keep an assistant turn's text "
                f"followed by {self.end_of_turn!r} once a tool message follows it; "
                "multi-turn rollouts append observations after the sampled turn"
            )
        return full[cut:]

    def encode(self, observation: Sequence[Mapping[str, Any]], closed: bool = True) -> Encoded:
        """The ids that follow a model turn: what the template renders after the turn's
        end, through the next assistant turn's opening. `closed=False` when the turn did
        not end on the end-of-turn token (the observation then closes the turn too)."""
        text = self._suffix(observation)
        if closed:
            text = text[len(self.end_of_turn) :]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Encoded(tuple(ids), text)

    def ends_turn(self, token_id: int | None) -> bool:
        """Whether a turn whose last sampled token is `token_id` closed itself."""
        return token_id is not None and token_id == self.end_of_turn_id
