"""The first notebook and the ``dask-pgas demo`` main job, run small on CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_notebook_runs(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("DASK_PGAS_NOTEBOOK_SIZE", "16MiB")
    monkeypatch.setenv("DASK_PGAS_NOTEBOOK_WORKERS", "2")
    monkeypatch.delenv("DASK_PGAS_SCHEDULER_FILE", raising=False)
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "01_pgas_rechunk.ipynb"), as_version=4)
    # the cluster cell runs twice, as a user re-running it does: the first cluster must end (a Client kept it
    # running, with its MPI job, until the kernel exited)
    start = next(i for i, c in enumerate(nb.cells) if "LocalMPICluster(" in c.source and c.cell_type == "code")
    first = nbformat.v4.new_code_cell("first_pids = cluster.worker_pids(); assert first_pids")
    gone = nbformat.v4.new_code_cell(
        "import time\n"
        "from dask_pgas.integration._orphan_guard import _alive\n"
        "deadline = time.monotonic() + 30\n"
        "while any(map(_alive, first_pids)) and time.monotonic() < deadline:\n"
        "    time.sleep(0.1)\n"
        "assert not any(map(_alive, first_pids)), first_pids\n"
        "assert set(cluster.worker_pids()).isdisjoint(first_pids)\n"
    )
    nb.cells[start + 1:start + 1] = [first, nbformat.from_dict(nb.cells[start]), gone]
    # so does the pgas cell: its last results are still held then (the timer would wait for them to go)
    timed = next(i for i, c in enumerate(nb.cells) if "timed(lambda" in c.source and 'method="pgas"' in c.source)
    nb.cells[timed + 1:timed + 1] = [nbformat.from_dict(nb.cells[timed])]
    # cells end in calls that return an awaitable inside the kernel's event loop: it waits, and shows nothing
    # (``cluster.close()`` last in a cell displayed ``<..._Done at 0x...>``)
    waits, closes = (nbformat.v4.new_code_cell(code) for code in ("cluster.wait_for_workers(1)", "cluster.close()"))
    nb.cells[-1:] = [waits, nb.cells[-1], closes]
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": ROOT}}).execute()
    assert waits.outputs == [] and closes.outputs == [], (waits.outputs, closes.outputs)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "result checked" in text
    for method in ("tasks", "p2p"):  # both peers ran (a failing peer prints "not available")
        assert re.search(rf"^{method}\s+[\d.]+ GB/s", text, re.M), text


def test_readme_snippets_run(tmp_path):
    """README's "Use" code as written: the Dask snippet (its own 4-worker cluster) and the PGAS core snippet on 2
    MPI ranks."""
    from ..mpirun import run_mpi

    with open(os.path.join(ROOT, "README.md")) as f:
        dask_snippet, core_snippet = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (tmp_path / "readme_dask.py").write_text(dask_snippet)
    out = subprocess.run([sys.executable, str(tmp_path / "readme_dask.py")], capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PE 3: tcp://" in out.stdout and "Traceback" not in out.stderr
    done = tmp_path / "done"
    (tmp_path / "readme_core.py").write_text(
        core_snippet + f"open({str(done)!r} + str(rank), 'w').write(repr(b.tolist()))\n")
    result = run_mpi(tmp_path / "readme_core.py", 2, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):  # rows 4*rank .. 4*rank+4 of the 8 x 4 array whose column pair j holds rank j
        assert (tmp_path / f"done{rank}").read_text() == repr([[0.0, 0.0, 1.0, 1.0]] * 4)


def test_demo_main_job():
    out = subprocess.run(
        [sys.executable, "-m", "dask_pgas.cli", "demo", "--size", "16MiB", "--workers", "2", "--repeats", "1",
         "--cpu"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pgas" in out.stdout and "WRONG" not in out.stdout
    assert out.stdout.count("OK") >= 3  # pgas, tasks and p2p results checked
    # each direction against the faster peer in the same direction (it mixed directions)
    assert re.search(r"pgas vs faster of tasks/p2p: [\d.]+x cols->rows, [\d.]+x rows->cols", out.stdout), out.stdout
    assert "mostly Dask's fixed cost per graph" in out.stdout  # (16 MiB: a small array, and the demo says so)
    assert "Traceback" not in out.stderr


# the demo, with Ctrl-C (SIGINT to its process group) while its second gather (pgas's result against Dask's
# tasks rechunk, the slow one: about 2 s at 256 MiB on 2 cores) waits
_INTERRUPT_IN_GATHER = """
import itertools, os, signal, sys, threading
from distributed import Client
from dask_pgas.cli import main

gather, calls = Client.gather, itertools.count(1)
def interrupted_gather(self, *args, **kwargs):
    if next(calls) != 2:
        return gather(self, *args, **kwargs)
    threading.Timer(0.3, os.killpg, (0, signal.SIGINT)).start()
    try:
        return gather(self, *args, **kwargs)
    except KeyboardInterrupt:
        print("interrupted in gather", flush=True)
        raise
Client.gather = interrupted_gather
sys.exit(main(sys.argv[1:]))
"""


def test_demo_interrupted_exits_quietly():
    """Ctrl-C (SIGINT to the terminal's process group) while the demo computes: exit code 130, one line saying
    so, no traceback (distributed's gather used to leave "Task exception was never retrieved ... AllExit"), and
    no scheduler or worker process left."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPT_IN_GATHER, "demo", "--size", "256MiB", "--workers", "2", "--repeats",
         "1", "--cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # (a background job ignores it)
    )
    try:
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted in gather" in out, out
    assert "dask-pgas: interrupted" in out and "Traceback" not in out and "never retrieved" not in out, out
    assert "GB/s" not in out  # interrupted before the first result
    deadline = time.monotonic() + 10
    while (left := _started_by(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left


def _started_by(pid: int) -> list[int]:
    """The live processes of a LocalMPICluster started by process ``pid`` (they carry its orphan-guard PID)."""
    from dask_pgas.integration._orphan_guard import ENV

    mark = f"{ENV}={pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def test_cli_version_and_help(capsys):
    from dask_pgas import __version__
    from dask_pgas.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"dask-pgas {__version__}"
    for args in (["--help"], ["demo", "--help"], ["world", "--help"]):
        with pytest.raises(SystemExit):
            main(args)
        text = capsys.readouterr().out
        assert "``" not in text and "--help" in text
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "the median is shown" in " ".join(capsys.readouterr().out.split())  # every option says what it does


def _fail(block):
    raise RuntimeError("this method failed on a worker")


def test_timer_raises_for_a_failed_method():
    """``wait`` returns for erred futures too: the demo's and the notebook's timer must raise, not report a
    rate for a method that failed (seen with Dask p2p on CuPy chunks)."""
    import dask.array as da
    from distributed import Client, LocalCluster

    from dask_pgas.cli import timed_persist

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        x = da.ones((4, 4), chunks=2)
        seconds, _ = timed_persist(client, lambda: x + 1, 1)
        assert seconds > 0
        with pytest.raises(RuntimeError, match="this method failed"):
            timed_persist(client, lambda: x.map_blocks(_fail, dtype=x.dtype, meta=x._meta), 1, warmup=True)


def test_timer_refuses_a_held_result_and_an_interrupted_run_holds_nothing(monkeypatch):
    """A result the cluster still holds would be handed back untimed: the timer says so within seconds (it
    waited 60 s for every repetition to be forgotten, so a notebook cell run again hung, then failed). A run
    interrupted while it waits keeps no future in its frame, which the traceback keeps alive."""
    import dask.array as da
    import distributed
    from distributed import Client, LocalCluster

    from dask_pgas.cli import timed_persist

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        x = da.ones((4, 4), chunks=2)
        held = (x + 1).persist()
        distributed.wait(held)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="a variable still refers to that result"):
            timed_persist(client, lambda: x + 1, 1)
        assert time.monotonic() - t0 < 30
        del held
        real = distributed.wait

        def interrupted(*args, **kwargs):
            monkeypatch.setattr(distributed, "wait", real)
            real(*args, **kwargs)
            raise KeyboardInterrupt

        monkeypatch.setattr(distributed, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt) as info:
            timed_persist(client, lambda: x + 2, 1)
        assert info.traceback  # (kept, with the timer's frame)
        seconds, result = timed_persist(client, lambda: x + 2, 2, warmup=True)  # the same keys: timed again
        assert seconds > 0 and float(result.sum().compute()) == 48


def test_the_copy_reference_copies_each_gpus_bytes_on_one_of_its_workers(monkeypatch):
    """Workers sharing a GPU share its bandwidth: each copied its own share alone, one after another, which
    overstated the copy (2 workers on one H200: 3.5-4.2 TB/s, past its memory bandwidth). One worker per GPU now
    copies the bytes of all its workers; GPUs are told apart by host and bus id (as the world describes them)."""
    from types import SimpleNamespace

    import dask_pgas
    from dask_pgas import cli

    info = {"w0": {"host": "h1", "gpu": "0000:01:00.0"}, "w1": {"host": "h1", "gpu": "0000:01:00.0"},
            "w2": {"host": "h1", "gpu": "0000:02:00.0"}, "w3": {"host": "h2", "gpu": "0000:01:00.0"},
            "w4": {"host": "h2"}}  # (a GPU the worker could not name: counted alone)
    monkeypatch.setattr(dask_pgas, "world", lambda client, detail: SimpleNamespace(info=info))
    copies = []

    class Client:
        def run(self, fn, *args, workers=None):
            assert fn is cli.device_copy_seconds and len(workers) == 1
            copies.append((workers[0], *args))
            return {workers[0]: args[0] / 1e12}  # 1 TB/s

    assert cli.device_copy_reference(Client(), 100) == 200 / 1e12
    assert sorted(copies) == [("w0", 200), ("w2", 100), ("w3", 100), ("w4", 100)]


@pytest.mark.parametrize("args, message", [
    (["demo", "--size", "bogus"], "not a size"),
    (["demo", "--size=-8MiB"], "must be at least 8 bytes"),
    (["demo", "--repeats", "0"], "must be at least 1"),
    (["demo", "--workers", "0"], "must be at least 1"),
    (["demo", "--workers", "-1"], "must be at least 1"),
    (["world", "--scheduler-file", "/nonexistent/scheduler.json"], "no scheduler file"),
    (["world", "--timeout", "-1", "--scheduler-file", "s.json"], "must be at least 1 s"),
    (["world", "--timeout", "nan", "--scheduler-file", "s.json"], "must be at least 1 s"),
    (["world", "--timeout", "inf", "--scheduler-file", "s.json"], "must be at most 1e+06 s"),
    (["world", "--timeout", "1e10", "--scheduler-file", "s.json"], "must be at most 1e+06 s"),
    (["demo", "--size", "1e999"], "not a size"),
    (["demo", "--size", "1e40"], "must be at most"),
])
def test_cli_refuses_bad_arguments_before_starting_anything(args, message, capsys):
    """Bad arguments exit with argparse's usage error (2), before a cluster starts; a missing scheduler file
    used to make ``world`` wait for ever (distributed polls for the file)."""
    from dask_pgas.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith(f"usage: dask-pgas {args[0]} ")  # the usage of the subcommand that was wrong


def test_cli_world_with_a_stale_scheduler_file(tmp_path, capsys):
    """A scheduler file whose scheduler is gone: a clear message and exit 1 after --timeout, not a traceback."""
    import json

    from dask_pgas.cli import main

    stale = tmp_path / "scheduler.json"
    stale.write_text(json.dumps({"type": "Scheduler", "id": "gone", "address": "tcp://127.0.0.1:1",
                                 "services": {}, "started": 0, "workers": {}}))
    assert main(["world", "--scheduler-file", str(stale), "--timeout", "2"]) == 1
    assert "no scheduler answers" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["garbage", "tcp://127.0.0.1", "foo://127.0.0.1:1"])
def test_cli_world_refuses_an_address_dask_cannot_parse(tmp_path, capsys, address):
    """A scheduler file whose address has no port or an unknown scheme: argparse's usage error saying so (exit 2),
    not distributed's traceback."""
    import json

    from dask_pgas.cli import main

    path = tmp_path / "scheduler.json"
    path.write_text(json.dumps({"address": address}))
    with pytest.raises(SystemExit) as exc:  # (no Client is made: distributed 2025.1's hung in its __del__)
        main(["world", "--scheduler-file", str(path), "--timeout", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"is not a scheduler file: its address {address!r} is unusable" in err and "Traceback" not in err


@pytest.mark.parametrize("content", ["", "{}", "garbage", "[1, 2]", '{"address": ""}', None])
def test_cli_world_refuses_what_is_not_a_scheduler_file(tmp_path, capsys, content):
    """An empty file (read again for up to --timeout, at most 2 s: the scheduler may be writing it), another
    file or a directory: argparse's usage error saying so (exit 2), not distributed's traceback."""
    from dask_pgas.cli import main

    path = tmp_path / "scheduler.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["world", "--scheduler-file", str(path), "--timeout", "1"])  # (a file is read again for 1 s)
    assert exc.value.code == 2
    assert "is not a scheduler file" in capsys.readouterr().err


def test_dask_cuda_example_says_what_it_needs():
    """``--help`` works without the GPU packages; without them the example says how to install them."""
    import importlib.util

    script = os.path.join(ROOT, "examples", "dask_cuda_rechunk.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--size" in out.stdout, out.stderr
    if importlib.util.find_spec("cupy") and importlib.util.find_spec("dask_cuda"):
        pytest.skip("CuPy and dask-cuda are installed: the example would start a GPU cluster")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "pip install dask-cuda" in out.stderr and "Traceback" not in out.stderr


def test_cli_world_reads_a_scheduler_file_still_being_written(tmp_path, capsys):
    """A scheduler file that is empty when `dask-pgas world` starts and written 0.3 s later is read again (the
    scheduler may be writing it): the command goes on to connect (here to a scheduler that is gone: exit 1),
    it does not refuse the file (exit 2)."""
    from dask_pgas.cli import main

    path = tmp_path / "scheduler.json"
    path.write_text("")
    content = json.dumps({"type": "Scheduler", "id": "gone", "address": "tcp://127.0.0.1:1", "services": {},
                          "started": 0, "workers": {}})
    timer = threading.Timer(0.3, path.write_text, (content,))
    timer.start()
    try:
        assert main(["world", "--scheduler-file", str(path), "--timeout", "2"]) == 1
    finally:
        timer.cancel()
    assert "no scheduler answers" in capsys.readouterr().err


def test_demo_fails_when_pgas_fails(monkeypatch, capsys):
    """The demo's exit code is its verdict (CI runs it): 1 when the pgas rechunk fails, even though the
    comparison methods worked."""
    from dask_pgas import cli

    real = cli.timed_persist

    def timed(client, make, repeats, **kwargs):
        if "'pgas'" in repr(make.__defaults__):
            raise RuntimeError("injected pgas failure")
        return real(client, make, repeats, **kwargs)

    monkeypatch.setattr(cli, "timed_persist", timed)
    assert cli.main(["demo", "--size", "1MiB", "--workers", "2", "--repeats", "1", "--cpu"]) == 1
    out = capsys.readouterr().out
    assert "injected pgas failure" in out and "tasks" in out
