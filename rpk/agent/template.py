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

This only works for templates that render earlier messages the same whatever follows
(append-only); the encoder checks that once, at construction, and fails in one line
naming the template. The tokenizer is passed in: this module imports no model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

_USER = "rpk-probe-question"
_PROBE = "rpk-probe-answer"
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
        base = self._render([], generation_prompt=False)
        answer = base.find(_PROBE)
        cut = base.find(self.end_of_turn, answer)
        if answer < 0 or cut < 0:
            raise TemplateError(
                f"the chat template of {self.name!r} does not end an assistant turn with "
                f"{self.end_of_turn!r}; multi-turn rollouts need to know where a turn ends"
            )
        self._cut = cut  # where the turn-ending token starts in a rendered probe
        self._end = cut + len(self.end_of_turn)
        full = self._render(_PROBE_OBSERVATION, generation_prompt=True)
        if full[: self._end] != base[: self._end]:
            raise TemplateError(
                f"the chat template of {self.name!r} is not append-only: an assistant turn "
                f"renders differently once a tool message follows it, so observations "
                f"cannot be appended to the sampled tokens"
            )

    def _render(self, observation: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        messages = [
            {"role": "user", "content": _USER}, {"role": "assistant", "content": _PROBE},
            *[dict(m) for m in observation],
        ]
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if self.tools:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def encode(self, observation: Sequence[Mapping[str, Any]], closed: bool = True) -> Encoded:
        """The ids that follow a model turn: what the template renders after the turn's
        end, through the next assistant turn's opening. `closed=False` when the turn did
        not end on the end-of-turn token (the observation then closes the turn too)."""
        full = self._render(observation, generation_prompt=True)
        text = full[self._end if closed else self._cut :]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Encoded(tuple(ids), text)

    def ends_turn(self, token_id: int | None) -> bool:
        """Whether a turn whose last sampled token is `token_id` closed itself."""
        return token_id is not None and token_id == self.end_of_turn_id
