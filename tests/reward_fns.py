"""Reward functions with veRL's signature, loaded by `module:function` in the tests."""

import asyncio
import time


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": True, "extra": 1}


async def async_exact(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return exact(data_source, solution_str, ground_truth)


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
