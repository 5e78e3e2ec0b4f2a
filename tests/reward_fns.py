"""Reward functions with veRL's signature, loaded by `module:function` in the tests."""

import asyncio
import os
import signal
import sys
import time
from pathlib import Path


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": True, "extra": 1}


async def async_exact(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return exact(data_source, solution_str, ground_truth)


# (solution_str, the failure kind a scorer counts, what its error says) of misbehaving's
# failures that every scorer contains alike
MISBEHAVING = [
    ("raise", "raised", "KeyError"),
    ("nan", "bad_value", "returned nan"),
    ("str", "bad_value", "returned str, not a number"),
    ("nodict", "bad_value", "without 'score'"),
]


def misbehaving(data_source, solution_str, ground_truth, extra_info=None):
    kind = solution_str
    if kind == "raise":
        raise KeyError("boom")
    if kind == "nan":
        return float("nan")
    if kind == "str":
        return "1.0"
    if kind == "nodict":
        return {"value": 1}
    if kind == "slow":
        time.sleep(0.5)
        return 1.0
    return 1.0


def hostile(data_source, solution_str, ground_truth, extra_info=None):
    """What only a process pool survives: hangs, crashes and floods, by solution_str."""
    kind, _, arg = solution_str.partition(":")
    if kind == "hang":
        time.sleep(600)
    elif kind == "exit":
        os._exit(int(arg or 3))
    elif kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "sys_exit":
        sys.exit(0)
    elif kind == "flood":
        chunk = "x" * 1_000_000 + "\n"
        for _ in range(int(arg or 5)):
            print(chunk)
            print(chunk, file=sys.stderr)
            os.write(1, chunk.encode())
            os.write(2, chunk.encode())
    elif kind == "pidfile":
        Path(extra_info["pidfile"]).write_text(str(os.getpid()))
        time.sleep(600)
    elif kind == "sleep":
        time.sleep(float(arg))
    elif kind == "bomb":  # MiB, allocated 16 at a time and kept past the call
        _HELD.extend(bytearray(16 << 20) for _ in range(int(arg) // 16))
    return misbehaving(data_source, kind, ground_truth, extra_info)


_HELD: list[bytearray] = []


def keyword_only(*, data_source, solution_str, ground_truth, extra_info=None):
    return exact(data_source, solution_str, ground_truth)


def wrong_names(source, text, truth, extra_info=None):
    return 1.0


def too_many(data_source, solution_str, ground_truth, extra_info, tokenizer):
    return 1.0


def no_extra_info(data_source, solution_str, ground_truth):
    return 1.0


def broken(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError(f"the checker is broken\non {solution_str!r}")


def prefix(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": solution_str.startswith(str(ground_truth))}


def hangs_on_5_percent(data_source, solution_str, ground_truth, extra_info=None):
    """The built-in task's checker, but one response in twenty (by a hash of its text)
    hangs for good: what a real run must survive."""
    import zlib

    from rpk.tasks import arith

    if zlib.crc32(solution_str.encode()) % 20 == 0:
        time.sleep(3600)
    return arith.compute_score(data_source, solution_str, ground_truth, extra_info)


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    """The share of digits in the response: varies across any model's samples, so every
    group has something to learn from (runs that must train, whatever the model)."""
    text = solution_str.strip()
    return sum(c.isdigit() for c in text) / max(1, len(text))


def length_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Shaped reward that depends on the scripted response: its length."""
    return {"score": len(solution_str) / 10, "acc": len(solution_str) < 10}
