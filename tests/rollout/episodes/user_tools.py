"""User tools loaded by import path in the tools-file tests."""

from __future__ import annotations


async def add(a: float, b: float) -> str:
    return str(a + b)


class Scaled:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    async def __call__(self, x: float) -> str:
        return str(self.factor * x)


def not_async(x: float) -> str:
    return str(x)
