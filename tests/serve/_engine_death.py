"""Load for the engine-death tests: clients that keep sending completions (half of them streamed) to a
served model while a test kills its engine, and the outcome of each request.

An outcome is "ok" (200, complete), "503" (the OpenAI error of a dead engine: a 503 response, or, for a
stream that had started, an error event of type service_unavailable) or anything else, which the tests
refuse. Every request has a client timeout: a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

REQUEST_TIMEOUT_S = 180.0  # a request that takes longer is a hang (far above the 503's few seconds)
RECOVERY_TIMEOUT_S = 300.0  # the most the tests wait for a 200 after a kill
BACKOFF_S = 0.5  # a client's pause after an error answer


@dataclass
class Load:
    url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    outcomes: list[tuple[float, str]] = field(default_factory=list)  # (end time, outcome)

    async def _streamed(self, http: httpx.AsyncClient, body: dict) -> str:
        async with http.stream("POST", self.url, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return _error_outcome(r.status_code, json.loads(await r.aread()))
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        errors = [json.loads(e) for e in events[:-1] if '"error"' in e]
        if errors:
            return _error_outcome(503 if _dead(errors[0]) else 200, errors[0])
        return "ok" if events and events[-1] == "[DONE]" else "incomplete stream"

    async def _plain(self, http: httpx.AsyncClient, body: dict) -> str:
        r = await http.post(self.url, json=body)
        if r.status_code == 200:
            return "ok" if r.json().get("choices") else "200 without choices"
        return _error_outcome(r.status_code, r.json())

    async def client(self, i: int, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=self.headers) as http:
            n = 0
            while not stop.is_set():
                body = {"model": self.model, "prompt": f"client {i} req {n}", "max_tokens": 8, "seed": n}
                send = self._streamed if i % 2 else self._plain
                try:
                    outcome = await send(http, body)
                except httpx.TimeoutException as e:
                    outcome = f"hang ({type(e).__name__})"
                self.outcomes.append((time.monotonic(), outcome))
                n += 1
                if outcome != "ok":  # back off, as an OpenAI client does: 8 clients retrying at once
                    await asyncio.sleep(BACKOFF_S)  # would slow the replacement replica's start

    async def served(self, count: int, since: float = 0.0) -> None:
        """Until `count` requests that ended after `since` were answered 200."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while sum(t > since and o == "ok" for t, o in self.outcomes) < count:
            assert time.monotonic() < deadline, (
                f"no {count} answers within {RECOVERY_TIMEOUT_S}s: {self.tally()}"
            )
            await asyncio.sleep(0.1)

    def tally(self, since: float = 0.0) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t, o in self.outcomes:
            if t > since:
                counts[o] = counts.get(o, 0) + 1
        return counts


def _dead(body: dict) -> bool:
    error = body.get("error") or {}
    return error.get("type") == "service_unavailable" and error.get("code") == "engine_dead"


def _error_outcome(status: int, body: dict) -> str:
    if status == 503 and _dead(body):
        return "503"
    return f"{status}: {json.dumps(body)[:300]}"


async def kill_under_load(load: Load, kill: Callable[[], object], clients: int = 8) -> dict[str, int]:
    """Run `clients` clients, kill (in a thread) once they are served, wait for 200s again: the outcomes
    of the requests that ended after the kill started."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(load.client(i, stop)) for i in range(clients)]
    try:
        await load.served(2 * clients)
        killed_at = time.monotonic()
        await asyncio.to_thread(kill)
        while "503" not in load.tally(killed_at):  # the requests in flight at the kill, and after it
            assert time.monotonic() < killed_at + RECOVERY_TIMEOUT_S, load.tally(killed_at)
            await asyncio.sleep(0.1)
        await load.served(2 * clients, since=time.monotonic())  # served again: the replica was replaced
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return load.tally(killed_at)


@dataclass(frozen=True)
class Answer:
    """What a client got: the HTTP status (a stream's error event counts as its error's status; 0: no
    answer within REQUEST_TIMEOUT_S), the OpenAI error code, the Retry-After header."""

    status: int
    code: str | None = None
    retry_after: str | None = None

    @property
    def dead_with_retry_after(self) -> bool:
        """The 503 of a dead engine, with a Retry-After of whole seconds >= 1."""
        after = self.retry_after or ""
        return (self.status, self.code) == (503, "engine_dead") and after.isdigit() and int(after) >= 1


async def answer(http: httpx.AsyncClient, url: str, model: str, n: int) -> Answer:
    """One completion (every other one streamed) to `url`/v1/completions."""
    body = {"model": model, "prompt": f"probe {n}", "max_tokens": 4, "seed": n, "stream": n % 2 == 1}
    try:
        r = await http.post(url + "/v1/completions", json=body)
    except httpx.TimeoutException as e:
        return Answer(0, f"hang ({type(e).__name__})")
    retry_after = r.headers.get("retry-after")
    if r.status_code != 200:
        return Answer(r.status_code, (r.json().get("error") or {}).get("code"), retry_after)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    errors = [json.loads(e)["error"] for e in events if '"error"' in e]
    if errors:  # a stream that had started (200), then failed: its error event
        return Answer(503 if errors[0].get("code") == "engine_dead" else 500, errors[0].get("code"))
    return Answer(200)


async def answers_for(url: str, model: str, seconds: float) -> list[Answer]:
    """One request at a time for `seconds` (each with a client timeout of REQUEST_TIMEOUT_S)."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        end, got = time.monotonic() + seconds, []
        while time.monotonic() < end:
            got.append(await answer(http, url, model, len(got)))
            await asyncio.sleep(0.2)
    return got


async def answers_until_served(url: str, model: str) -> list[Answer]:
    """One request at a time (after an error, BACKOFF_S apart) until one is answered 200."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        deadline, got = time.monotonic() + RECOVERY_TIMEOUT_S, []
        while not got or got[-1].status != 200:
            assert time.monotonic() < deadline, f"no 200 within {RECOVERY_TIMEOUT_S}s: {got[-3:]}"
            if got:
                await asyncio.sleep(BACKOFF_S)
            got.append(await answer(http, url, model, len(got)))
    return got


def engine_core_killed_under_load(url: str, model: str, app_name: str, headers: dict) -> tuple[dict, dict]:
    """Kill the model's vLLM engine core under load (kill_under_load): only 200s and 503s, the kill seen,
    then a new engine core in the same replica. The engine's description before and after."""
    from ray import serve

    handle = serve.get_deployment_handle(f"LLMServer:{model}", app_name=app_name)
    old = handle.describe.remote().result()
    assert old["engine_core_pids"], old
    load = Load(url + "/v1/completions", model, headers=headers)
    kill = functools.partial(os.kill, old["engine_core_pids"][0], signal.SIGKILL)
    tally = asyncio.run(kill_under_load(load, kill))
    assert set(tally) <= {"ok", "503"}, tally  # nothing else: no 500, no hang
    assert tally.get("503"), tally  # the kill was seen
    new = handle.describe.remote().result()
    assert new["engine_core_pids"] and set(new["engine_core_pids"]).isdisjoint(old["engine_core_pids"])
    assert new["replica_pid"] == old["replica_pid"], "Serve replaced the replica: its ingress went away"
    assert (new["restarts"], new["state"]) == (old["restarts"] + 1, "serving"), new
    return old, new


def check_the_deadline_ends_a_running_stream(config, model: str, timeout_s: float) -> None:
    """In this process: a replica (LLMServer) for `config` streams a 100-token completion; the failover
    slot retires its engine with a preemption deadline already past. The stream must end early with the
    replica's 503 naming SlicePreemptedError (its last chunk), not run on or hang; a request after it gets
    the same 503, and the replica's health check fails with a builtin exception naming the error (what
    Serve's controller can read without importing the engine: issue 45)."""
    from tpuray.serve.llm.deployments.server import LLMServer
    from tpuray.serve.llm.openai.errors import OpenAIError
    from tpuray.slices.drain import PreemptionInfo

    body = {"model": model, "prompt": "ab", "max_tokens": 100, "ignore_eos": True, "stream": True}

    async def run() -> list:
        server = await LLMServer.create(config)
        try:
            assert server.slot is not None
            stream = server.handle_stream("completions", body)
            chunks = [await anext(stream)]  # the request runs on the engine
            past = PreemptionInfo(
                deadline_ms=int(time.time() * 1000) - 1000, preempted_node_to_ranks={"n": [0]}
            )
            await server.slot._retire(server.slot._lease, past)  # the deadline came: the engine ends
            chunks += [chunk async for chunk in stream]
            late = await server.handle("completions", {**body, "stream": False})
            try:
                await server.check_health()
            except Exception as e:  # noqa: BLE001 - the failed check is what the test reads
                return chunks, late, e
            return chunks, late, None
        finally:
            server.shutdown()

    chunks, late, health = asyncio.run(asyncio.wait_for(run(), timeout=timeout_s))
    error = chunks[-1]
    assert isinstance(error, OpenAIError), chunks[-3:]
    assert error.status == 503 and "SlicePreemptedError" in str(error), error
    assert len(chunks) < 100  # it ended early, not after its 100 tokens
    assert isinstance(late, OpenAIError) and (late.status, late.code) == (503, "engine_dead"), late
    assert type(health) is RuntimeError and "SlicePreemptedError" in str(health), repr(health)
