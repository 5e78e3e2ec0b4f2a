"""A user's own tool, exactly as docs/multi-turn.md declares one: an async function whose
type hints and Google docstring give its schema (or a schema in `agent.tool_schemas`)."""

from __future__ import annotations

PRICES = {"apple": 0.5, "pear": 0.75, "fig": 1.25}
RATES = {"EUR": 1.0, "USD": 1.1}


async def price(item: str, quantity: int, currency: str = "EUR") -> str:
    """Looks up what some fruit costs.

    Args:
        item: the fruit, e.g. "apple"
        quantity: how many of it
        currency: the currency of the answer (EUR or USD)
    """
    if item not in PRICES:
        raise KeyError(f"no price for {item!r}; we sell {', '.join(PRICES)}")
    return f"{PRICES[item] * quantity * RATES[currency]:.2f} {currency}"
