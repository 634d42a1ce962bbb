"""dsc.reader.turns: the interpreter's switch interval is lowered while a loader's producer runs, and put
back as it was found (the benchmark of why: benchmarks/busy_loop_bench.py)."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from dsc.reader import MemmapDataset, turns

from conftest import tiny_dataset

DEFAULT_S = 0.005  # CPython's


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    return tiny_dataset(tmp_path_factory.mktemp("turns"), seed=4, records_per_shard=5)


@pytest.fixture(autouse=True)
def interpreter_default(monkeypatch):
    monkeypatch.delenv(turns.ENV, raising=False)
    sys.setswitchinterval(DEFAULT_S)
    yield
    sys.setswitchinterval(DEFAULT_S)


def running(ds: MemmapDataset, **options):
    """A loader whose producer runs (its first batch taken), and the iterator that holds it."""
    loader = ds.loader(4, order="random", seed=0, **options)
    batches = iter(loader)
    next(batches)
    return loader, batches


def test_a_running_producer_lowers_the_interval_and_the_last_to_stop_puts_it_back(ds: MemmapDataset) -> None:
    first, _a = running(ds)
    assert sys.getswitchinterval() == pytest.approx(turns.SWITCH_S)
    second, _b = running(ds)
    first.close()
    assert sys.getswitchinterval() == pytest.approx(turns.SWITCH_S)  # the second still runs
    second.close()
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)


def test_an_interval_already_lower_or_changed_meanwhile_is_left_as_the_user_set_it(ds: MemmapDataset) -> None:
    sys.setswitchinterval(0.0002)
    loader, _ = running(ds)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    loader.close()
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    sys.setswitchinterval(DEFAULT_S)
    loader, _ = running(ds)
    sys.setswitchinterval(0.003)  # the user's own choice, made while the producer ran
    loader.close()
    assert sys.getswitchinterval() == pytest.approx(0.003)


def test_the_environment_turns_it_off_or_sets_it_and_a_bad_value_is_refused_where_the_loader_is_made(
        ds: MemmapDataset, monkeypatch) -> None:
    monkeypatch.setenv(turns.ENV, "off")
    loader, _ = running(ds)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
    loader.close()
    monkeypatch.setenv(turns.ENV, "0.0004")
    loader, _ = running(ds)
    assert sys.getswitchinterval() == pytest.approx(0.0004)
    loader.close()
    for bad in ("fast", "0", "5"):
        monkeypatch.setenv(turns.ENV, bad)
        with pytest.raises(ValueError, match=f"DSC_SWITCH_INTERVAL='{bad}': give 'off'"):
            ds.loader(4)


def _report_interval(queue) -> None:
    queue.put(sys.getswitchinterval())


@pytest.mark.skipif(not hasattr(multiprocessing, "get_context") or sys.platform == "win32", reason="needs fork")
def test_a_child_forked_while_a_producer_runs_gets_the_interval_back(ds: MemmapDataset) -> None:
    """The child has no producer thread; nothing there would ever put the interval back."""
    loader, _ = running(ds)
    fork = multiprocessing.get_context("fork")
    queue = fork.Queue()
    child = fork.Process(target=_report_interval, args=(queue,))
    child.start()
    assert queue.get(timeout=30) == pytest.approx(DEFAULT_S)
    child.join(timeout=30)
    assert sys.getswitchinterval() == pytest.approx(turns.SWITCH_S)  # the parent's producer still runs
    loader.close()
