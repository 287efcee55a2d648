"""A trio event loop on a thread of its own, driven from asyncio.

py-libp2p runs on trio and p2pdiloco on asyncio; the libp2p transport keeps its host on a
`TrioBridge`'s thread and crosses between the two loops only here. From asyncio,
`run(fn, *args)` runs a trio function in the bridge's nursery and awaits its result
(cancelling the awaiting task cancels the trio task); from trio, `run_asyncio(fn, *args)`
runs a coroutine function on the asyncio loop that started the bridge (a served RPC's
handler) and awaits it. `stop()` ends the trio side and joins its thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, TypeVar

import trio

from p2pdiloco.transport.base import TransportClosed

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TrioBridge:
    """One trio thread, started from asyncio; `name` names the thread and the log lines."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None

    async def start(self, main: Callable[[], Awaitable[None]], timeout_s: float) -> None:
        """Run `main()` as trio's main task on a new thread; returns once it calls
        `serve()`. Raises what `main` raised before that, or TimeoutError after `timeout_s`."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, args=(main,), name=self.name, daemon=True)
        self._thread.start()
        await asyncio.wait_for(asyncio.wrap_future(self._started), timeout_s)

    def _run(self, main: Callable[[], Awaitable[None]]) -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - reported through `_started`
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                logger.warning("%s_thread_failed error=%r", self.name, exc)

    async def serve(self, nursery: trio.Nursery) -> None:
        """(trio, from `main`) Report the start done, run what `run()` hands over in
        `nursery` until `stop()`, then cancel the nursery."""
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = nursery
        self._started.set_result(None)
        try:
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        finally:
            self._nursery = None

    async def stop(self, timeout_s: float) -> bool:
        """Ask the trio side to finish and wait up to `timeout_s` for its thread; False if
        the thread still runs then."""
        token, stop, thread = self._token, self._stop, self._thread
        if token is not None and stop is not None:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(stop.set)
        if thread is None:
            return True
        await asyncio.to_thread(thread.join, timeout_s)
        return not thread.is_alive()

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` on the trio thread and await its result from asyncio; cancelling
        the awaiting task cancels the trio task. TransportClosed once the thread is gone."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        scope = trio.CancelScope()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        async def runner() -> None:
            result: Any = None
            error: BaseException | None = TransportClosed(f"the {self.name} transport is shutting down")
            try:
                with scope:
                    try:
                        result, error = await fn(*args), None
                    except Exception as exc:  # noqa: BLE001 - handed to the asyncio side
                        error = exc
            finally:  # also when the whole nursery is cancelled: the awaiting side must wake
                with suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle, result, error)

        def launch() -> None:
            if self._nursery is None:
                loop.call_soon_threadsafe(settle, None, TransportClosed(f"the {self.name} transport is not running"))
            else:
                self._nursery.start_soon(runner)

        token = self._token
        if token is None:
            raise TransportClosed(f"the {self.name} transport is not running")
        try:
            token.run_sync_soon(launch)
        except trio.RunFinishedError:
            raise TransportClosed(f"the {self.name} transport is not running") from None
        try:
            return await done
        except asyncio.CancelledError:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)
            raise

    async def run_asyncio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """(trio) Run `fn(*args)` on the asyncio loop that started the bridge and await its
        result; cancelling the trio task cancels the asyncio one."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(fn(*args), self._loop)
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(finished.set)

        future.add_done_callback(wake)
        try:
            await finished.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()
