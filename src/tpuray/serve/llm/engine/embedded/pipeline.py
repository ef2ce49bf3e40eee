"""Async scheduling: launch step k+1 before step k is read back (what vLLM's async scheduling does).

`StepPipeline` decides what the engine's loop (engine.py) launches and reads back next. Synchronously
(`ahead=False`) a step is launched, read back and processed before the next one is scheduled. With
`ahead=True`, step k+1 is scheduled and launched while step k runs: its decode rows take step k's greedy
ids where they are, on the device (`FROM_DEVICE`: they never go to the host and back); then the host
reads step k's ids and applies its stop conditions while step k+1 runs. A sequence that step k finishes
(a stop token or string) has computed one more token in step k+1, which `Scheduler.process` discards
(never streamed, never counted); one that step k finishes by length is left out of step k+1.

Only a greedy-only step (no logits read back, no prompt logprobs) is followed ahead: a sampled token is
drawn on the host, so the next step needs it from there. The steps keep their shapes (the same buckets,
no new compilation): only the decode rows' token ids change where they come from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpuray.serve.llm.engine.embedded.scheduler import Scheduler, Sequence
from tpuray.serve.llm.engine.embedded.step_plan import Step


@dataclass
class Flight:
    """A scheduled step: its sequences and batch (rows in the same order), and once launched the
    handle its `collect` takes."""

    seqs: list[Sequence]
    batch: Step
    need_logits: bool
    handle: Any = None

    @property
    def greedy_only(self) -> bool:
        """Its tokens are the device's argmax and nothing else is read back: the next step can take
        them on the device."""
        return not self.need_logits and all(n is None for _, _, _, n in self.batch)


class StepPipeline:
    """At most two steps in flight (`ahead`) or one (synchronous); see the module docstring."""

    def __init__(self, scheduler: Scheduler, ahead: bool) -> None:
        self.scheduler = scheduler
        self.ahead = ahead
        self.in_flight: deque[Flight] = deque()
        self.steps_ahead = 0  # steps launched before the previous one was read back

    def next_step(self) -> Flight | None:
        """The step to launch now (None: none may be launched before a step is read back)."""
        sched = self.scheduler
        if not self.in_flight:
            seqs, batch = sched.schedule()
        elif self.ahead and len(self.in_flight) == 1 and self.in_flight[0].greedy_only:
            seqs, batch = sched.schedule(ahead=self.in_flight[0].seqs)
            self.steps_ahead += bool(seqs)
        else:
            return None
        return Flight(seqs, batch, sched.needs_logits(seqs)) if seqs else None

    def launched(self, flight: Flight, handle: Any) -> None:
        flight.handle = handle
        self.in_flight.append(flight)

    def to_collect(self, launched_now: bool) -> Flight | None:
        """The step to read back now: the older of two in flight, or the only one unless it was just
        launched and the next turn may launch a step ahead of it."""
        if not self.in_flight:
            return None
        followed = self.ahead and self.in_flight[-1].greedy_only
        if len(self.in_flight) == 2 or not launched_now or not followed:
            return self.in_flight.popleft()
        return None

    def process(self, flight: Flight, result: Any) -> None:
        """Hand a read-back step's StepResult to the scheduler (sampling, stop conditions, outputs)."""
        self.scheduler.process(flight.seqs, result.logits, result.prompt_logprobs, result.token_ids)

    def turn(self, launch: Callable[[Step, bool], Any], collect: Callable[[Any], Any]) -> bool:
        """One synchronous turn (a loop without asyncio, e.g. a benchmark's): launch what may be
        launched, read back and process what must be. False when there was nothing to do."""
        flight = self.next_step()
        if flight is not None:
            self.launched(flight, launch(flight.batch, flight.need_logits))
        done = self.to_collect(flight is not None)
        if done is not None:
            self.process(done, collect(done.handle))
        return flight is not None or done is not None
