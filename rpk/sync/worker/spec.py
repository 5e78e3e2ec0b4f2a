"""rpk's speculative-decoding proposer inside vLLM's worker, and what rpk's worker
extension does with it.

vLLM's supported hook: `speculative_config={"method": "custom_class", "model":
"rpk.sync.worker.spec.DraftProposer", "num_speculative_tokens": k}` makes the worker
import this class, build it with the engine's `VllmConfig`, call `load_model` once and
then `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`
after every step, taking one draft (a list of token ids, maybe empty) per row. vLLM
verifies each drafted token against the target model by rejection sampling, so what
the proposer guesses changes how fast responses come, never what they are.

The texts it drafts from arrive through `collective_rpc` (rpk's worker extension,
`rpk.sync.worker.ext`): a round's prompts with their draft texts and its draft-length
schedule before the round (`rpk_spec_round`), finished siblings as they come
(`rpk_spec_add`); `rpk_spec_take` reads what each source's drafts did. The matching
itself is `rpk.sync.worker.spec_index.DraftIndex`.

Imported by vLLM's worker, never by rpk's main process (which names the class by path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from rpk.core.drafts import DraftSource, PromptDrafts
from rpk.sync.worker.spec_index import DraftIndex

if TYPE_CHECKING:
    import numpy as np
    from vllm.config import VllmConfig

PROPOSER = "rpk.sync.worker.spec.DraftProposer"


class DraftProposer:
    """vLLM's `custom_class` proposer over a `DraftIndex`. Until rpk sends a round it
    knows no prompt and drafts nothing (the warm-up request, validation)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None
        self.index = DraftIndex(int(spec.num_speculative_tokens))
        if spec.num_speculative_tokens_per_batch_size:
            self.index.schedule = tuple(
                (int(lo), int(hi), min(int(k), self.index.max_k))
                for lo, hi, k in spec.num_speculative_tokens_per_batch_size
            )

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: vLLM's CPU runner calls this once all the same."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        return self.index.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)


def proposer_of(worker: Any) -> DraftProposer | None:
    """The worker's rpk proposer, None when it speculates otherwise (vLLM's ngram) or
    not at all."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    return drafter if isinstance(drafter, DraftProposer) else None


def set_round(worker: Any, schedule: Sequence[Sequence[int]], sources: Sequence[int],
              prompts: Sequence[Sequence[Any]]) -> None:
    proposer = proposer_of(worker)
    if proposer is not None:
        proposer.index.reset(schedule, [DraftSource(s) for s in sources],
                             [PromptDrafts.from_wire(p) for p in prompts])


def add(worker: Any, prompts: Sequence[Sequence[Any]]) -> None:
    proposer = proposer_of(worker)
    if proposer is not None:
        for p in prompts:
            proposer.index.add(PromptDrafts.from_wire(p))


def take(worker: Any) -> dict[int, list[int]]:
    """Per source (its int value): [rows drafted for, draft tokens, tokens accepted]."""
    proposer = proposer_of(worker)
    if proposer is None:
        return {}
    return {int(s): [c.drafts, c.tokens, c.accepted] for s, c in proposer.index.take_counts().items()}
