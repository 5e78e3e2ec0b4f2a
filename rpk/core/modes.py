"""The modes the memory plan, the trainer and the loop agree on, each defined once.

The config keeps them as the strings a user types; `rpk.assembly.box` parses them once into
these, and from there every package passes the typed value.
"""

from __future__ import annotations

import enum


class Offload(enum.Enum):
    """Trainer state moved to host memory while vLLM generates."""

    NONE = "none"
    OPTIMIZER = "optimizer"  # AdamW's moments
    ALL = "all"  # moments and parameter shards

    @property
    def moves_params(self) -> bool:
        return self is Offload.ALL

    @property
    def moves_optimizer(self) -> bool:
        return self is not Offload.NONE


class StreamMode(enum.StrEnum):
    """When the trainer works on a round's completed groups."""

    NONE = "none"  # train after the round, as veRL does
    THREAD = "thread"  # on the trainer thread while the tail generates
    BORROW = "borrow"  # on the devices of replicas the fleet lends (the paper's)


class RestLevel(enum.IntEnum):
    """vLLM's sleep level while a colocated trainer has the GPUs (`AsyncLLM.sleep`)."""

    KEEP_WEIGHTS = 1  # the weights backed up to host: a LoRA sync sends the adapter alone
    DROP_WEIGHTS = 2  # the weights dropped: the full sync after training replaces them

    @property
    def drops_weights(self) -> bool:
        """The replica serves no weights until the next sync loads them."""
        return self is RestLevel.DROP_WEIGHTS

    @classmethod
    def for_sync(cls, adapter: bool) -> RestLevel:
        """How a colocated fleet rests where the plan does not say: a LoRA sync is the
        adapter alone, so its replicas keep the base; a full sync replaces every weight."""
        return cls.KEEP_WEIGHTS if adapter else cls.DROP_WEIGHTS


class TransferChoice(enum.StrEnum):
    """The `rollout.weight_transfer` choices that name no backend of their own, spelled
    once for the config's checks and the weight path (`rpk.sync.backends.resolve` works
    them out per run into a `Backend`)."""

    AUTO = "auto"
    M2N = "m2n"  # every trainer rank sends its own shards


class Runner(enum.StrEnum):
    """vLLM's runner: a generative model, or a pooling one (a reward model's score). A
    replica's settings name it, and so does each verdict kind of the judge (what serves it)."""

    GENERATE = "generate"
    POOLING = "pooling"
