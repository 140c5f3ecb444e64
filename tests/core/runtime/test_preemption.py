"""Preemption notices (issue 31): the three pollers against real local HTTP servers that
answer as GCE, AWS (IMDSv2) and Azure do (pitstop.testing.metadata), the watcher thread
(its rate, its timeouts, a fork), the save a notice asks for with its deadline in view,
SIGTERM's grace, and the keywords' checks. Jobs that exit run in subprocesses."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import pitstop
from pitstop.core.errors import InvalidArgumentError
from pitstop.core.runtime import preemption
from pitstop.core.runtime.preemption import Aws, Azure, Gce, Notice, Watcher
from pitstop.testing.metadata import GCE_PATH, FakeMetadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ENVS = ("PITSTOP_PREEMPTION", "PITSTOP_PREEMPTION_EXIT", "PITSTOP_GRACE_SECONDS",
        "KUBERNETES_SERVICE_HOST", "PITSTOP_GCE_METADATA", "PITSTOP_AWS_METADATA",
        "PITSTOP_AZURE_METADATA")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake(monkeypatch):
    with FakeMetadata() as server:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        yield server


def until(predicate, timeout: float = 8.0, what: str = "the state"):
    """Poll ``predicate`` until it is true (returns its value) or fail after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def records(directory) -> list[dict]:
    doc = json.loads((directory / ".pitstop" / "directory.json").read_text())
    return doc.get("preemption", [])


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENVS and k != "PITSTOP_SUPERVISOR"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


# ====================================================================== the pollers
def test_gce_answers_only_with_its_header_and_the_poller_reads_true(fake):
    req = urllib.request.Request(fake.url + GCE_PATH)  # no Metadata-Flavor: refused as GCE does
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=2)
    assert e.value.code == 403
    gce = Gce()
    assert gce.detect() and gce.poll() is None
    fake.announce("gce")
    notice = gce.poll()
    assert notice is not None and notice.source == "gce"
    assert abs(notice.deadline_unix - (notice.noticed_unix + 30)) < 1e-6
    assert abs(notice.noticed_unix - time.time()) < 5


def test_aws_takes_one_token_then_reads_the_instance_action(fake):
    aws = Aws()
    assert aws.poll() is None  # 404: nothing scheduled
    deadline = fake.announce("aws", in_seconds=90)
    notice = aws.poll()
    assert notice is not None and notice.deadline_unix == deadline
    assert "terminate" in notice.key
    aws.poll()
    assert fake.count("aws", "/latest/api/token") == 1  # the token is reused
    assert all(r[3].get("x-aws-ec2-metadata-token") for r in fake.requests
               if r[2] == "/latest/meta-data/spot/instance-action")


def test_azure_reads_a_preempt_event_and_its_not_before(fake):
    azure = Azure()
    assert azure.detect() and azure.poll() is None
    deadline = fake.announce("azure", in_seconds=45)
    notice = azure.poll()
    assert notice is not None and notice.deadline_unix == deadline and notice.key
    assert all(r[3].get("metadata") == "true" for r in fake.requests if r[0] == "azure")


def test_auto_keeps_the_services_that_answer_as_theirs(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pitstop")
    with FakeMetadata(services=("aws",)) as only_aws:
        for name in ("gce", "aws", "azure"):
            monkeypatch.setenv(preemption.ENDPOINTS[name][0], only_aws.url)
        w = Watcher(("auto",), lambda n: None)
        assert [p.name for p in w._pollers()] == ["aws"]
    with FakeMetadata(services=()) as nothing:  # a machine of no cloud: 404 everywhere
        for name in ("gce", "aws", "azure"):
            monkeypatch.setenv(preemption.ENDPOINTS[name][0], nothing.url)
        w = Watcher(("auto",), lambda n: None).start()
        until(lambda: any("found no metadata service" in r.getMessage()
                          for r in caplog.records), what="the line saying none answers")
        w.stop()  # it waits to ask again; a close ends it at once
        until(lambda: not w._thread.is_alive(), what="the watcher to end")
    said = [r for r in caplog.records if "found no metadata service" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


def test_auto_finds_a_service_that_comes_up_late(monkeypatch):
    monkeypatch.setattr(preemption, "AUTO_RETRY_S", 0.2)
    with FakeMetadata(services=()) as nothing:
        for name in ("gce", "aws", "azure"):
            monkeypatch.setenv(preemption.ENDPOINTS[name][0], nothing.url)
        notices: list[Notice] = []
        w = Watcher(("auto",), notices.append).start()
        try:
            until(lambda: nothing.count("gce") >= 1, what="a first look")
            with FakeMetadata(services=("gce",)) as late:
                monkeypatch.setenv(preemption.ENDPOINTS["gce"][0], late.url)
                late.announce("gce")
                until(lambda: notices, what="the late service's notice")
            assert notices[0].source == "gce"
        finally:
            w.stop()


# ====================================================================== the watcher
def test_the_watcher_polls_each_source_at_most_once_a_second_and_tells_new_notices_once(fake):
    notices: list[Notice] = []
    w = Watcher(("gce", "aws", "azure"), notices.append).start()
    try:
        until(lambda: fake.count("gce") >= 1, what="a first poll")
        fake.announce("gce")
        until(lambda: notices, what="the notice")
        polled = fake.count("gce")
        until(lambda: fake.count("gce") >= polled + 2, what="two more polls")
        assert len(notices) == 1  # the same notice polled again is not a later one
        fake.withdraw("gce")
        polled = fake.count("gce")
        until(lambda: fake.count("gce") >= polled + 1, what="a poll that sees it withdrawn")
        fake.announce("gce")
        until(lambda: len(notices) == 2, what="the later notice")
    finally:
        w.stop()
    assert not w.running
    for source, path in (("gce", GCE_PATH), ("aws", "/latest/meta-data/spot/instance-action"),
                         ("azure", "/metadata/scheduledevents")):
        times = [r[4] for r in fake.requests if r[0] == source and r[2].split("?")[0] == path]
        assert len(times) >= 3, (source, times)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert min(gaps) >= 0.95, (source, gaps)  # (the server's clock: a little slack)


def test_a_hanging_service_never_slows_step_and_close_does_not_wait_for_it(
        tmp_path, monkeypatch):
    on_threads: list[threading.Thread] = []
    real = preemption._request

    def spy(*args, **kwargs):
        on_threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(preemption, "_request", spy)
    with FakeMetadata(delay_s=5.0) as slow:
        for k, v in slow.env().items():
            monkeypatch.setenv(k, v)
        mgr = pitstop.CheckpointManager(tmp_path / "ck", preemption=["gce", "aws", "azure"],
                                        save_every_steps=10_000, memory_tier=False)
        state = {"w": np.zeros(16)}
        worst = 0.0
        end = time.monotonic() + 1.5
        step = 0
        while time.monotonic() < end:
            t0 = time.perf_counter()
            mgr.step(step, state)
            worst = max(worst, time.perf_counter() - t0)
            step += 1
            time.sleep(0.005)
        until(lambda: slow.count("gce") + slow.count("aws") >= 2, what="polls")
        t0 = time.perf_counter()
        mgr.close()
        closing = time.perf_counter() - t0
    assert on_threads and threading.main_thread() not in on_threads
    assert all(t.name == "pitstop-preemption" for t in on_threads)
    assert worst < 0.25, worst  # a 5 s answer; each request gives up after 0.5 s anyway
    assert closing < 2.5, closing


def test_in_a_forked_child_the_watcher_does_not_run(tmp_path, fake):
    mgr = pitstop.CheckpointManager(tmp_path / "ck", preemption="gce", memory_tier=False)
    watcher = mgr._res.watcher
    until(lambda: fake.count("gce") >= 1, what="a first poll")
    pid = os.fork()
    if pid == 0:  # the child: no watcher thread, and a notice marks nothing
        code = 0
        try:
            mgr._signals.mark(Notice("gce", time.time(), None), False)
            code = 3 if watcher.running or mgr._signals.pending is not None else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert watcher.running  # the parent's goes on
    mgr.close()
    assert not watcher.running


# ====================================================================== notices and saves
def test_a_notice_saves_at_the_next_step_records_it_and_training_goes_on(tmp_path, fake, caplog):
    caplog.set_level(logging.INFO, logger="pitstop")
    d = tmp_path / "ck"
    mgr = pitstop.CheckpointManager(d, preemption="gce", save_every_steps=10_000)
    state = {"w": np.zeros(64)}
    saved: list[int] = []
    step = 1  # (every 10_000 steps: step 0 would save)
    announced = None
    with mgr:
        end = time.monotonic() + 8
        while time.monotonic() < end and len(saved) < 1:
            state["w"][:] = step
            if step == 5:
                announced = fake.announce("gce")
            if mgr.step(step, state) is not None:
                saved.append(step)
            step += 1
            time.sleep(0.01)
        assert saved and saved[0] > 5, saved
        for more in range(step, step + 3):  # it trains on, nothing more is saved
            assert mgr.step(more, state) is None
    meta = mgr_meta(d, saved[0])
    assert meta["source"] == "gce" and meta["deadline_unix"] == pytest.approx(announced, abs=5)
    [rec] = records(d)
    assert rec["source"] == "gce" and rec["step"] == saved[0]
    assert rec["durable_unix"] >= rec["noticed_unix"] and rec["fits"] is None
    assert rec["deadline_unix"] == pytest.approx(rec["noticed_unix"] + 30)
    lines = [r for r in caplog.records if "preemption notice from gce at" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert f"saved step {saved[0]}, durable at " in lines[0].getMessage()
    assert "s before the deadline" in lines[0].getMessage()


def mgr_meta(d, step: int) -> dict:
    with pitstop.CheckpointManager(d, read_only=True) as reader:
        return reader.metadata(step).user_metadata["preemption"]


def test_a_deadline_out_of_reach_warns_and_saves_by_the_fastest_path(tmp_path, fake, caplog):
    d = tmp_path / "ck"
    mgr = pitstop.CheckpointManager(d, preemption="aws", compression="zstd", incremental=True,
                                    save_every_steps=10_000)
    engine = mgr._engine
    persisted: list[tuple[int, object, bool]] = []
    mgr.hooks["before_write"] = lambda s: persisted.append(
        (s, engine.compression, engine.incremental))
    state = {"w": np.arange(1000.0)}
    mgr.save(0, state).wait()  # measured: the expected persist time
    tier = engine.tier
    if tier is not None:  # (where /dev/shm is usable) a normal save is described there
        assert [m.get("step") for m, _ in tier.candidates()] == [0]
    fake.announce("aws", in_seconds=0)  # the deadline is now: nothing fits
    until(lambda: mgr._signals.pending is not None, what="the notice")
    assert mgr.step(1, state) is not None
    assert persisted[0] == (0, "zstd", True) and persisted[1] == (1, None, False)
    assert (engine.compression, engine.incremental) == ("zstd", True)  # its own again
    if tier is not None:  # the fastest path wrote nothing to the memory tier
        assert [m.get("step") for m, _ in tier.candidates()] == []
    mgr.close()
    [rec] = records(d)
    assert rec["fits"] is False and rec["expected_persist_s"] > 0 and rec["step"] == 1
    text = caplog.text
    assert "may not be durable in time; saving it by the fastest path" in text
    assert "s AFTER the deadline" in text


EXIT_JOB = textwrap.dedent("""
    import sys, time
    import numpy as np
    import pitstop
    mgr = pitstop.CheckpointManager(sys.argv[1], preemption="azure", preemption_exit=True)
    state = {"w": np.zeros(32)}
    step = 0
    with mgr:
        while True:
            state["w"][:] = step
            print("STEP", step, flush=True)
            mgr.step(step, state)
            step += 1
            time.sleep(0.02)
""")


def test_preemption_exit_exits_like_sigterm_once_the_save_is_durable(tmp_path, fake):
    d = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", EXIT_JOB, str(d)],
                            env=child_env(**fake.env()), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("STEP 3"):
                break
        fake.announce("azure", in_seconds=20)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM, err  # 143 in a shell, as SIGTERM's save
    [rec] = records(d)
    assert rec["source"] == "azure" and rec["durable_unix"] is not None and rec["step"] > 3
    assert "preemption notice from azure at" in err and f"saved step {rec['step']}" in err
    with pitstop.CheckpointManager(d, read_only=True) as reader:
        assert reader.latest_step() == rec["step"]


TERM_JOB = textwrap.dedent("""
    import sys, time
    import numpy as np
    import pitstop
    mgr = pitstop.CheckpointManager(sys.argv[1])
    state = {"w": np.zeros(32)}
    with mgr:
        for step in range(100_000):
            print("STEP", step, flush=True)
            time.sleep(0.1)  # (the signal lands here: the boundary is 0.1 s after it)
            mgr.step(step, state)
""")


@pytest.mark.parametrize("grace", ["20", "0.001"])
def test_sigterm_with_a_grace_period_records_its_deadline_and_says_if_it_was_met(
        tmp_path, grace):
    d = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", TERM_JOB, str(d)],
                            env=child_env(PITSTOP_GRACE_SECONDS=grace),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("STEP 2"):
                break
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM, err
    [rec] = records(d)
    assert rec["source"] == "SIGTERM"
    assert rec["deadline_unix"] == pytest.approx(rec["noticed_unix"] + float(grace))
    assert "preemption notice from SIGTERM at" in err
    if grace == "20":
        assert rec["durable_unix"] < rec["deadline_unix"] and rec["fits"] is None
        assert "s before the deadline" in err
    else:
        assert rec["fits"] is False and "s AFTER the deadline" in err
        assert "fastest path" in err


def test_a_plain_sigusr1_is_recorded_without_a_deadline(tmp_path):
    d = tmp_path / "ck"
    with pitstop.CheckpointManager(d, save_every_steps=10_000) as mgr:
        state = {"w": np.zeros(4)}
        mgr.step(1, state)
        os.kill(os.getpid(), signal.SIGUSR1)
        until(lambda: mgr._signals.pending is not None, what="SIGUSR1")
        assert mgr.step(2, state) is not None
    [rec] = records(d)
    assert rec["source"] == "SIGUSR1" and rec["deadline_unix"] is None and rec["step"] == 2


# ====================================================================== the keywords
@pytest.mark.parametrize("kwargs, named", [
    ({"preemption": "gcp"}, "'gcp'"),
    ({"preemption": 5}, "5"),
    ({"preemption": ["gce", 3]}, "3"),
    ({"preemption": "gce,"}, "''"),
    ({"preemption_exit": "yes"}, "'yes'"),
    ({"grace_seconds": -1}, "-1"),
    ({"grace_seconds": 0}, "0"),
    ({"grace_seconds": float("nan")}, "nan"),
    ({"grace_seconds": "30"}, "'30'"),
    ({"grace_seconds": True}, "True"),
])
def test_bad_values_are_refused_naming_them_and_the_accepted_ones(tmp_path, kwargs, named):
    with pytest.raises(InvalidArgumentError) as e:
        pitstop.CheckpointManager(tmp_path / "ck", **kwargs)
    text = str(e.value)
    assert named in text and next(iter(kwargs)) in text
    assert ("'auto', 'gce', 'aws', 'azure'" in text or "True or False" in text
            or "positive number of seconds" in text)
    assert not (tmp_path / "ck").exists()  # refused before anything was written


@pytest.mark.parametrize("var, value", [("PITSTOP_PREEMPTION", "gce,bogus"),
                                        ("PITSTOP_GRACE_SECONDS", "soon"),
                                        ("PITSTOP_PREEMPTION_EXIT", "maybe")])
def test_bad_environment_values_are_refused_naming_the_variable(tmp_path, monkeypatch,
                                                                var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(InvalidArgumentError, match=var):
        pitstop.CheckpointManager(tmp_path / "ck")


def test_the_environment_applies_when_the_keywords_are_left_alone(tmp_path, monkeypatch, fake):
    monkeypatch.setenv("PITSTOP_PREEMPTION", "gce, aws")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with pitstop.CheckpointManager(tmp_path / "a") as mgr:
        assert mgr._res.watcher.sources == ("gce", "aws")
        assert mgr._signals.grace_seconds == 30.0  # Kubernetes' default
    monkeypatch.setenv("PITSTOP_PREEMPTION", "off")
    monkeypatch.setenv("PITSTOP_GRACE_SECONDS", "12.5")
    with pitstop.CheckpointManager(tmp_path / "b") as mgr:
        assert mgr._res.watcher is None and mgr._signals.grace_seconds == 12.5
    with pitstop.CheckpointManager(tmp_path / "c", preemption="azure", grace_seconds=3) as mgr:
        assert mgr._res.watcher.sources == ("azure",) and mgr._signals.grace_seconds == 3.0


def test_a_service_that_trickles_its_answer_cannot_hold_a_poll(monkeypatch) -> None:
    import http.server

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Metadata-Flavor", "Google")
            self.end_headers()
            for _ in range(100):  # a byte every 0.1 s: each read is quick, the whole is 10 s
                try:
                    self.wfile.write(b"F")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PITSTOP_GCE_METADATA", f"http://127.0.0.1:{server.server_port}")
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            Gce().poll()
        assert time.monotonic() - t < 5.0  # the poll's deadline (0.5 s), not the answer's 10 s
    finally:
        server.shutdown()
        server.server_close()


def test_an_azure_preempt_event_without_notbefore_is_due_now(monkeypatch) -> None:
    with FakeMetadata(("azure",)) as fake:
        for k, v in fake.env().items():
            monkeypatch.setenv(k, v)
        fake.announce("azure", 30)
        fake._notices["azure"]["NotBefore"] = ""  # Azure's way of saying: started already
        before = time.time()
        notice = Azure().poll()
        assert notice is not None and notice.deadline_unix is not None
        assert before <= notice.deadline_unix <= time.time()


def test_the_fake_services_command_refuses_a_time_in_the_past() -> None:
    r = subprocess.run([sys.executable, "-m", "pitstop.testing.metadata", "--announce", "aws",
                        "--after", "-5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "0 or more" in r.stderr and "Traceback" not in r.stderr
