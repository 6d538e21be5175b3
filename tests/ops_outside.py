"""Counting the torch operators a step runs outside its graph's replay (on CUDA each one is a launch the host
pays for, and a small kernel between two graphs): CPU runs stand in, since they dispatch the same operators."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class OpsOutside(TorchDispatchMode):
    """Within ``with OpsOutside() as ops``, each step that ``ops.steps_of`` counts gets a list in ``ops.steps``
    of the operators it runs (views, ``empty`` and ``detach`` aside), but those of the functions made ``quiet``
    (a graph's replay or capture, the LM head)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[str]] = []
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not func.is_view and func.overloadpacket.__name__ not in ("empty", "detach"):
            self.steps[-1].append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def quiet(self, fn: Callable) -> Callable:
        def run(*args):
            was, self.on = self.on, False
            try:
                return fn(*args)
            finally:
                self.on = was
        return run

    def steps_of(self, forward_step: Callable, counted: Callable) -> Callable:
        """``forward_step``, counting the steps for which ``counted(step)``."""
        def run(step):
            self.on = counted(step)
            self.steps.append([])
            try:
                return forward_step(step)
            finally:
                self.on = False
        return run
