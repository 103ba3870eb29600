"""Progress lines while the suite compiles kernels or runs a long test (a pytest plugin).

Compiling the CuTe DSL kernels takes seconds to minutes per configuration, in fixtures
(``cache.load_kernels`` through ``testing.sim``) and in tests (``cache.compile_images``,
or fresh processes that compile with other tune strings); pytest shows nothing until the
test ends.  This plugin prints, through pytest's terminal reporter with capture suspended:

* ``compiling kernels W=8 K=256 N=64 (1 of 2: select_push)`` before each kernel this
  process compiles, and ``compiled ... in 6.1 s`` after it;
* ``... still running after 60 s`` every ``DSA_TEST_HEARTBEAT_S`` seconds (default 60) of a
  test that has not ended, which covers compiles in child processes too.

``tests/conftest.py`` registers it (``pytest_sessionstart`` below).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time

ENV_HEARTBEAT = "DSA_TEST_HEARTBEAT_S"


def pytest_sessionstart(session):
    session.config.pluginmanager.register(Progress(session.config), "dsa-progress")


class Progress:
    def __init__(self, config):
        self.config = config
        self.lock = threading.Lock()
        self.context = threading.local()  # the configuration compile_images is compiling
        self.running = None  # (nodeid, start time) of the test in progress
        self.interval = float(os.environ.get(ENV_HEARTBEAT, "60"))
        # The terminal as it is now, before pytest redirects file descriptor 1 around each
        # test: the heartbeat thread writes here, never touching pytest's capture state.
        self.fd = os.dup(1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._heartbeat, name="dsa-progress", daemon=True)
        self.thread.start()
        self._wrap_cache()

    # ------------------------------------------------------------------ output

    def say(self, msg: str) -> None:
        """One line from the main thread, through the terminal reporter (capture suspended)."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        with self.lock:
            if reporter is None or capman is None:
                self._raw(msg)
                return
            with capman.global_and_fixture_disabled():
                tw = getattr(reporter, "_tw", None)  # after -q's dots: a line of its own
                if getattr(tw, "width_of_current_line", 0):
                    tw.line()
                reporter.write_line(msg)

    def _raw(self, msg: str) -> None:
        os.write(self.fd, ("\n" + msg + "\n").encode())

    def _heartbeat(self) -> None:
        while not self.stop.wait(min(self.interval / 4, 5.0)):
            running = self.running
            if running is None:
                continue
            nodeid, start, told = running
            elapsed = time.monotonic() - start
            if elapsed >= told + self.interval:
                self.running = (nodeid, start, told + self.interval)
                with self.lock:
                    self._raw(f"{nodeid}: still running after {elapsed:.0f} s")

    # ------------------------------------------------------------------ test boundaries

    def pytest_runtest_logstart(self, nodeid, location):
        self.running = (nodeid, time.monotonic(), 0.0)

    def pytest_runtest_logfinish(self, nodeid, location):
        self.running = None

    def pytest_sessionfinish(self, session):
        self.stop.set()
        self.thread.join(timeout=10)
        os.close(self.fd)

    # ------------------------------------------------------------------ kernel compiles

    def _wrap_cache(self) -> None:
        try:
            from jax_dsa_exchange.kernels import cache
        except ImportError:
            return
        if getattr(cache.compile_kernel, "_dsa_progress", False):
            return
        cache.compile_images = self._wrap_images(cache, cache.compile_images)
        cache.compile_kernel = self._wrap_kernel(cache, cache.compile_kernel)

    @staticmethod
    def _config(fn, args, kwargs) -> dict:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def _wrap_images(self, cache, compile_images):
        @functools.wraps(compile_images)
        def wrapped(*args, **kwargs):
            c = self._config(compile_images, args, kwargs)
            names = None
            try:  # the images compile_images makes, in its order (for "n of m")
                key = (c["world"], c["topk"], c["local_topk"], c.get("rescue_list", False))
                names = (["select_push"] + (["select_push_lean"] if cache.has_lean_producer(*key) else [])
                         + (["merge_wide"] if cache.has_wide_merge(*key) else []) + ["merge"])
            except Exception:  # noqa: BLE001 - a bad configuration: compile_images says why
                pass
            self.context.names = names
            try:
                return compile_images(*args, **kwargs)
            finally:
                self.context.names = None

        wrapped._dsa_progress = True
        return wrapped

    def _wrap_kernel(self, cache, compile_kernel):
        @functools.wraps(compile_kernel)
        def wrapped(*args, **kwargs):
            c = self._config(compile_kernel, args, kwargs)
            key = cache.compiled_key(**c)
            if key in getattr(cache, "_COMPILED", {}):  # compiled before: no compile, no line
                return compile_kernel(*args, **kwargs)
            name = c.get("kernel")
            names = getattr(self.context, "names", None) or [name]
            n, m = (names.index(name) + 1, len(names)) if name in names else (1, 1)
            what = (f"W={c.get('world')} K={c.get('topk')} N={c.get('local_topk')}"
                    + (" rescue_list" if c.get("rescue_list") else ""))
            self.say(f"compiling kernels {what} ({n} of {m}: {name})")
            t0 = time.monotonic()
            out = compile_kernel(*args, **kwargs)
            self.say(f"compiled {name} {what} in {time.monotonic() - t0:.1f} s")
            return out

        wrapped._dsa_progress = True
        return wrapped
