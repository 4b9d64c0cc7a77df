"""The scheduler runs small CPU steps on one intra-op thread and large ones on the process's
threads (coordinator/serving/scheduler_threads.py), and leaves the count as it found it."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from coordinator.model.engine import Engine
from coordinator.serving.outputs import Output
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import Scheduler, SchedulerLimits
from coordinator.serving.scheduler_threads import StepThreads
from tests.hf_models import make_checkpoint


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_threads_by_work() -> None:
    cpu = StepThreads(torch.device("cpu"), hidden_size=128, small_work=128 * 256, threads=8)
    assert cpu.threads(1) == 1
    assert cpu.threads(255) == 1
    assert cpu.threads(256) == 8
    # CUDA steps keep the process's count: their host threads only launch kernels
    assert StepThreads(torch.device("cuda"), 128, 128 * 256, threads=8).threads(1) == 8


@pytest.mark.usefixtures("two_threads")
def test_step_sets_and_restores() -> None:
    st = StepThreads(torch.device("cpu"), hidden_size=64, small_work=64 * 10)
    assert st.configured == 2
    with st.step(9):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with st.step(10):
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="boom"), st.step(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)  # as another thread's setting would leave a thread started after it
    with st.step(10):
        assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_scheduler_runs_small_steps_on_one_thread(tmp_path) -> None:
    """A 40-token prefill (large for this policy) runs on both threads, its decodes on one, and
    the scheduler thread ends on both. Another thread setting one for itself (as a checkpoint
    reader pool does) leaves torch's default for threads started later at one, so the scheduler
    thread starts on one: the configured count is set, not inherited."""
    make_checkpoint("qwen3_moe", tmp_path)
    eng = Engine.from_checkpoint(str(tmp_path), num_pages=32, page_size=4)
    seen: list[tuple[int, int]] = []  # (tokens, threads) per step
    step = eng.step

    def recording_step(items, *args, **kwargs):
        seen.append((sum(len(t) for _, t in items), torch.get_num_threads()))
        return step(items, *args, **kwargs)

    eng.step = recording_step  # type: ignore[method-assign]
    s = Scheduler(eng, SchedulerLimits(max_batch_tokens=64, max_running=4, max_context=128))
    s.step_threads = StepThreads(eng.device, eng.config.hidden_size, eng.config.hidden_size * 8)
    after: queue.Queue[int] = queue.Queue()
    done: queue.Queue[Output] = queue.Queue()

    def sink(out: Output) -> None:  # on the scheduler thread, between its steps
        if out.finish_reason is not None:
            after.put(torch.get_num_threads())
            done.put(out)

    other = threading.Thread(target=torch.set_num_threads, args=(1,))
    other.start()
    other.join()
    s.start()
    try:
        s.submit(list(range(3, 43)), SamplingParams(max_new_tokens=4, ignore_eos=True), sink)
        assert done.get(timeout=60).error is None
    finally:
        s.stop()
    assert seen == [(40, 2), (1, 1), (1, 1), (1, 1)]
    assert after.get_nowait() == 2
