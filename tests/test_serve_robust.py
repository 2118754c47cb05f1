"""No request stops ``speculant serve``'s worker: whatever one job's preparation or decoding raises
ends that job alone (400 for input it cannot take, 500 otherwise), on both worker paths, and a
stream that fails after its headers ends with an error event. If the worker stops anyway (a fault
outside any job's own handling), every open request gets an answer, ``/health`` says 503 with the
reason, new requests get 503, and ``speculant serve`` exits with status 1 instead of hanging."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from jinja2.exceptions import TemplateError

from speculant import SpeculativeDecoder
from speculant.serve.scheduler import Failed, Finished, Job, Scheduler, WorkerStopped

from serve_helpers import CHAT_TEMPLATE, RunningServer, free_port, wait_healthy
from tiny import tiny_model_dir

MESSAGES = [{"role": "user", "content": "w1 w2 w3 w4"}]
GOOD = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
DIE = {**GOOD, "stop": ["die"]}  # the marker the injected worker fault looks for


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("models") / "target", seed=0))


def _decoder(target):
    dec = SpeculativeDecoder(target, method="lookup", dtype="float32", tree_budget="fixed")
    dec.tokenizer.chat_template = CHAT_TEMPLATE
    return dec


@pytest.fixture(scope="module")
def expected(target):
    return _decoder(target).generate(MESSAGES, 8).text


class _Faulty:
    """A decoder that raises where a prompt (or, for a request the server renders to token ids,
    a stop string) asks it to: ``boom-start`` in ``start`` (as the tokenizer once did on a lone
    surrogate), ``boom-template`` there too (as a chat template refusing the conversation does),
    ``boom-join`` in ``join``, ``boom-step`` at the third decoding step (after a stream's headers);
    ``delay`` s per step."""

    def __init__(self, decoder, delay: float = 0.0):
        self._dec, self.delay, self._doomed, self._late = decoder, delay, set(), set()

    def __getattr__(self, name):
        return getattr(self._dec, name)

    def start(self, prompt, *args, **kwargs):
        seen = json.dumps([prompt, kwargs.get("stop")])
        if "boom-template" in seen:  # a chat template's own raise_exception
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        if "boom-start" in seen:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        gen = self._dec.start(prompt, *args, **kwargs)
        if "boom-join" in seen:
            self._doomed.add(gen)
        if "boom-step" in seen:
            self._late.add(gen)
        return gen

    def join(self, batch, gen, on_events=None, on_error=None):
        if gen in self._doomed:
            raise RuntimeError("injected join fault")
        steps = [0]

        def events(g, evs):
            time.sleep(self.delay)
            steps[0] += 1
            if g in self._late and steps[0] == 3:
                raise RuntimeError("injected step fault")
            if on_events is not None:
                on_events(g, evs)
        return self._dec.join(batch, gen, events, on_error)


def _run_jobs(scheduler: Scheduler, jobs: list[Job]) -> list:
    """Each job's last event, the jobs submitted one after another."""
    async def run():
        out = []
        for job in jobs:
            ticket = scheduler.submit(job, asyncio.get_running_loop())
            while not isinstance(event := await asyncio.wait_for(ticket.events.get(), 60), (Finished, Failed)):
                pass
            out.append(event)
        return out
    return asyncio.run(run())


@pytest.mark.parametrize("max_batch", [1, 3])
def test_whatever_a_job_raises_ends_that_job_alone(target, expected, max_batch):
    scheduler = Scheduler(_Faulty(_decoder(target)), max_queue=8, max_batch=max_batch)
    try:
        good = Job(MESSAGES, 8)
        jobs = [Job([{"role": "user", "content": "\ud800 hi"}], 4), good,  # the schema is bypassed here
                Job("w1 \x00 w2", 4), good,
                Job("w1", 4, stop=("\udc00",)), good,
                Job([{"role": "user", "content": "boom-start"}], 4), good,
                Job([{"role": "user", "content": "boom-template"}], 4), good]
        if max_batch > 1:
            jobs += [Job([{"role": "user", "content": "boom-join"}], 4), good]
        events = _run_jobs(scheduler, jobs)
    finally:
        scheduler.close()
    assert [(e.status, e.param) for e in events[0:6:2]] == [(400, "messages[0].content"), (400, "prompt"),
                                                            (400, "stop[0]")]
    assert "lone surrogate" in events[0].message and "NUL" in events[2].message
    assert events[6].status == 500 and "TypeError" in events[6].message
    assert events[8].status == 400 and "chat template refused" in events[8].message
    if max_batch > 1:
        assert events[10].status == 500 and "injected join fault" in events[10].message
    assert all(isinstance(e, Finished) and e.text == expected for e in events[1::2])
    assert scheduler.problem is None


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_fault_after_the_headers_ends_the_stream_with_an_error_event(target, expected, max_batch):
    s = RunningServer(_Faulty(_decoder(target)), max_batch=max_batch)
    try:
        lines: list[str] = []
        body = {**GOOD, "max_tokens": 100, "stop": ["boom-step"]}  # a stop string never met: the marker
        _stream(s.url, body, threading.Event(), lines)
        assert lines[-1] == "[DONE]" and "choices" in json.loads(lines[0])  # the stream had begun
        error = json.loads(lines[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
        assert "injected step fault" in error["message"]
        assert s.post("/v1/chat/completions", GOOD).json()["choices"][0]["message"]["content"] == expected
    finally:
        s.stop()


def _faulty_take(take):
    """A fault outside any job's own handling: taking the marked job from the queue raises."""
    def faulty(self, block=True):
        ticket = take(self, block)
        if ticket is not None and ticket.job.stop == ("die",):
            raise RuntimeError("injected worker fault")
        return ticket
    return faulty


def _stream(url: str, body: dict, first: threading.Event, out: list) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                first.set()


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_dead_worker_answers_every_request_and_health_says_503(target, expected, max_batch, monkeypatch):
    monkeypatch.setattr(Scheduler, "_take", _faulty_take(Scheduler._take))
    s = RunningServer(_Faulty(_decoder(target), delay=0.05), max_batch=max_batch)
    try:
        assert s.post("/v1/chat/completions", GOOD).json()["choices"][0]["message"]["content"] == expected
        lines: list[str] = []
        if max_batch > 1:  # a stream in flight when the worker stops ends with an error event
            first = threading.Event()
            streamer = threading.Thread(target=_stream, args=(s.url, {**GOOD, "max_tokens": 300}, first, lines))
            streamer.start()
            assert first.wait(30)
        dead = s.post("/v1/chat/completions", DIE, timeout=30)
        assert dead.status_code == 500 and "injected worker fault" in dead.json()["error"]["message"]
        if max_batch > 1:
            streamer.join(30)
            assert not streamer.is_alive() and lines[-1] == "[DONE]"
            error = json.loads(lines[-2])["error"]
            assert error["type"] == "server_error" and "worker stopped" in error["message"]
        health = httpx.get(s.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "injected worker fault" in health.json()["error"]
        for stream in (False, True):
            refused = s.post("/v1/chat/completions", {**GOOD, "stream": stream}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "worker_stopped"
        loop = asyncio.new_event_loop()
        try:
            with pytest.raises(WorkerStopped):
                s.app.state.scheduler.submit(Job("w1", 1), loop)
        finally:
            loop.close()
    finally:
        s.stop()


FAULTY_SERVE = textwrap.dedent("""
    import sys
    from speculant.serve.scheduler import Scheduler
    from test_serve_robust import _faulty_take

    Scheduler._take = _faulty_take(Scheduler._take)
    from speculant.cli.commands import main
    sys.exit(main(sys.argv[1:]))
""")


def test_speculant_serve_exits_non_zero_when_its_worker_dies(target, tmp_path):
    script = tmp_path / "faulty_serve.py"
    script.write_text(FAULTY_SERVE)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, str(script), "serve", "--target", target, "--dtype", "float32",
                             "--method", "ar", "--port", str(port)], stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        # the tiny model has no chat template: the marked request goes to /v1/completions
        die = {"model": "default", "prompt": "w1 w2 w3 w4", "max_tokens": 8, "temperature": 0, "stop": ["die"]}
        dead = httpx.post(url + "/v1/completions", json=die, timeout=30)
        assert dead.status_code == 500, dead.text
        assert "injected worker fault" in dead.json()["error"]["message"]
        try:  # it may already have stopped listening; if it answers, it says it is not healthy
            assert httpx.get(url + "/health", timeout=2).status_code == 503
        except httpx.HTTPError:
            pass
        assert proc.wait(timeout=60) == 1
        err = proc.stderr.read()
        assert "the decoding worker stopped (RuntimeError: injected worker fault)" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
