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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

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


def expand_reference(output: torch.Tensor, input: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: Any, replace_to: Any, MAX_NUM_TOKENS: int | None = None) -> None:
    """vLLM's `rejection_sampler.expand_kernel` in torch: request i's value (with
    `replace_from` read as `replace_to`) written over its tokens, `cu_num_tokens[i-1]`
    up to `cu_num_tokens[i]`, into `output` in place, whatever its dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input == replace_from, torch.as_tensor(replace_to, dtype=input.dtype), input)
    total = int(counts.sum())
    output[:total] = values.repeat_interleave(counts).to(output.dtype)


def install_cpu_kernels() -> str:
    """On vLLM's CPU platform without Triton: replace its C++ fallback of the rejection
    sampler's `expand_kernel`, which vLLM 0.32 gets wrong. It casts the output to int64
    and writes into that copy, so a float (or int32) output is never written: the
    per-token temperatures, top-k and top-p of every random-sampling step that verifies
    drafts are uninitialised memory, and the sampled tokens and their log-probs are
    garbage (greedy decoding never reads them). vLLM's own kernel-override registry
    (`vllm.triton_utils.dispatcher.register_kernels`) takes the torch version instead;
    it must run after the platform's registration (in the worker's start), so rpk calls
    it through `collective_rpc` before the engine's first request.

    vLLM 0.32's registry rebinds by scanning every loaded module and raises on llvmlite's
    (`vars()` of its `_lib_fn_wrapper`), which numba loads; vLLM's own platform
    registration raises there too. rpk then rebinds the kernel's two holders itself,
    exactly as the registry would have: a narrow patch of vLLM's private
    `rejection_sampler._expand.kernel`, checked by a probe after it. Returns how it went
    in ("registry" or "rebound"), "" where no correction is needed."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import KernelOverride, register_kernels
    from vllm.v1.sample import rejection_sampler as rs

    if not current_platform.is_cpu() or HAS_TRITON:
        return ""
    how = "registry"
    try:
        register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_reference})
    except Exception:  # noqa: BLE001 - its scan of every module trips over some (llvmlite's)
        # The kernel's two holders, rebound as the registry would have.
        wrapper = KernelOverride(rs.expand_kernel, expand_reference)
        rs.expand_kernel = wrapper
        rs._expand.kernel = wrapper
        rs._expand.__dict__.pop("_kernel_arg_names", None)
        how = "rebound"
    got = rs.expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3)
    if got.tolist() != [0.5, 2.0, 2.0]:
        raise RuntimeError(f"vLLM's expand kernel still gives {got.tolist()} for [0.5, 2.0, 2.0]: "
                           "speculative sampling on this CPU would be wrong")
    return how


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
