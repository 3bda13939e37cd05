"""How the compiled CPU steps get built: keys that hold only what a trace depends on (so a new
max_model_len or max_num_seqs reuses the graphs), and the background compile that lets an engine
serve eagerly, and correctly, until its graphs are ready."""

from __future__ import annotations

import gc
import logging
import re
import threading
from pathlib import Path

import pytest
import torch

import fastgen
import fastgen.kernels
import fastgen.cpu.background_compile as background_compile
import fastgen.cpu.compiled_decode as compiled_decode
from fastgen import LLM, SamplingParams
from fastgen.cpu.saved_graphs import traced_sources
from fastgen.cpu.step_threads import STEP_THREADS, StepThreads
from fastgen.layers.rotary import rope_table_positions
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def cpu_llm(model: str, compile_mode: str, **kwargs) -> LLM:
    """A blocking engine compiles every graph in its own process unless a test asks for helpers."""
    settings = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 8,
                "max_num_batched_tokens": 64, "compile_processes": 1, **kwargs}
    return LLM(model, enforce_eager=False, compile_mode=compile_mode, **settings)


def assert_equal_transformers(reference, model: str, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(model, [prompt], GREEDY.max_tokens)[0]


@pytest.mark.parametrize(("max_model_len", "limit", "positions"), [
    (100, 8192, 4096), (4096, 8192, 4096), (4097, 8192, 8192), (5000, 40960, 8192), (300, 1024, 1024),
    (9000, 9000, 9000), (1, 2048, 2048),
])
def test_rope_tables_round_up_to_shared_sizes(max_model_len, limit, positions):
    assert rope_table_positions(max_model_len, limit) == positions


def test_a_new_max_model_len_or_max_num_seqs_reuses_the_compiled_graphs(tiny_models, private_cache):
    model = tiny_models["qwen3"]
    paths = cpu_llm(model, "blocking", max_model_len=64, max_num_seqs=4).engine.runner.compiled_decode.paths
    assert cpu_llm(model, "blocking", max_model_len=1000, max_num_seqs=16).engine.runner.compiled_decode.paths == paths
    # The KV cache's shape is part of the graph: another block count is another graph.
    assert cpu_llm(model, "blocking", max_model_len=64, num_kv_blocks=128).engine.runner.compiled_decode.paths != paths


# Two engines' compiles: test-slow. The fast suite compiles through the background path below
# and `test_compiled_decode`.
@pytest.mark.slow
def test_engines_of_other_lengths_run_the_same_graphs_correctly(tiny_models, reference, private_cache):
    """An engine whose block tables are one block wide (max_model_len <= block_size) compiles the
    graphs; one with wider tables loads and runs them: the width is a size of the graphs, not a
    constant of the first engine's. Both equal transformers.

    The first engine compiles as blocking engines do by default: its first step compiles the
    layer group's graph here while a helper process compiles the head's, and waits for it; the
    bench's report gives their times."""
    from fastgen.bench.environment import compile_times

    model = tiny_models["qwen3"]
    prompts = random_prompts([9], seed=91) + random_prompts([5, 12], seed=92)
    runners = []
    for max_model_len, processes in ((64, None), (1000, 1)):
        llm = cpu_llm(model, "blocking", block_size=256, num_kv_blocks=8, max_model_len=max_model_len,
                      compile_processes=processes)
        compiled = llm.engine.runner.compiled_decode
        assert_equal_transformers(reference, model, prompts[:1], llm.generate(prompts[:1], GREEDY))
        assert all(compiled.paths[name].is_file() for name in ("layers", "head"))  # after one request
        assert_equal_transformers(reference, model, prompts[1:], llm.generate(prompts[1:], GREEDY))
        runners.append(llm.engine.runner)
    first, second = (runner.compiled_decode for runner in runners)
    assert set(first.helpers.seconds) == {"head"} and first.helpers.children == []  # the helper's, ended
    assert first.paths == second.paths and first.loaded == {"head"} and not first.failed  # the head: saved by it
    times = compile_times(runners[0])
    assert not times["compiled_graphs"]["layers"]["from_cache"] and times["compiled_graphs"]["head"]["from_cache"]
    assert times["compile_s"] >= first.first_call_seconds["layers"]
    assert second.loaded == {"layers", "head"} and not second.failed and second.helpers is None


def test_every_file_a_compiled_step_runs_is_in_its_key(tiny_models, private_cache, monkeypatch):
    """The key digests only the packages the steps trace (`traced_sources`); here each graph is
    traced and the files its operations came from must all be among them."""
    seen: set[str] = set()

    def recording_backend(gm, example_inputs):
        for node in gm.graph.nodes:
            seen.update(re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or ""))
        raise RuntimeError("traced, not compiled")  # the step then runs eagerly

    monkeypatch.setattr(compiled_decode, "inductor_backend", recording_backend)
    llm = cpu_llm(tiny_models["qwen3"], "blocking")
    llm.generate(random_prompts([7], seed=81), GREEDY)  # prefill graph, then decode
    assert llm.engine.runner.compiled_decode.failed == {"layers"}  # traced (so no head is built)
    head = cpu_llm(tiny_models["qwen3"], "blocking")
    head.engine.runner.compiled_decode.only = {"head"}  # as a helper that builds the head's graph
    head.generate(random_prompts([7], seed=81), GREEDY)
    assert head.engine.runner.compiled_decode.failed == {"head"}  # traced too
    roots = (Path(fastgen.__file__).resolve().parent, Path(fastgen.kernels.__file__).resolve().parent)
    ours = {Path(f).resolve() for f in seen if Path(f).resolve().is_relative_to(roots[0])
            or Path(f).resolve().is_relative_to(roots[1])}
    assert any(path.name == "llama_family.py" for path in ours)  # the recording saw the model's code
    assert ours <= set(traced_sources()), sorted(ours - set(traced_sources()))


def test_background_compile_serves_eagerly_then_switches_to_the_graphs(tiny_models, reference, private_cache):
    """The engine answers while a child process compiles, eagerly and with a thread fewer (the
    child's core); once the child has ended, the next step gives the thread back and loads the
    graphs it saved. Every output equals transformers', before and after."""
    model = tiny_models["qwen3"]
    full = STEP_THREADS.full_threads()
    llm = cpu_llm(model, "background")
    compiled = llm.engine.runner.compiled_decode
    child = compiled.background
    assert child.process is not None  # started with the engine
    # Until the child has ended, whatever it has saved by then: here one that does not end.
    compiled.background = StillRunning(child)
    prompts = random_prompts([11, 5], seed=71)
    assert_equal_transformers(reference, model, prompts, llm.generate(prompts, GREEDY))
    assert compiled.loaded == set() and torch.get_num_threads() == max(1, full - 1)
    # A step that wants prompt logprobs runs eagerly, outside the compiled step, with the same
    # thread fewer: its one step in a thread of its own, set to every thread first.
    seen = []

    def prompt_logprobs_alone() -> None:
        torch.set_num_threads(full)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
        seen.append(torch.get_num_threads())

    driver = threading.Thread(target=prompt_logprobs_alone)
    driver.start()
    driver.join()
    assert seen == [max(1, full - 1)]

    assert child.process.wait(timeout=600) == 0
    compiled.background = child
    alone = random_prompts([9], seed=72)
    assert_equal_transformers(reference, model, alone, llm.generate(alone, GREEDY))
    assert torch.get_num_threads() == full
    assert_equal_transformers(reference, model, prompts, llm.generate(prompts, GREEDY))
    assert compiled.loaded == {"layers", "head"}  # from the child, none compiled here
    assert set(compiled.background_seconds) == compiled.loaded
    llm.engine.shutdown()


class StillRunning:
    """A background compile whose child has not ended (whatever it has saved)."""

    def __init__(self, child: background_compile.BackgroundCompile):
        self.running = True
        self.stopped = False
        self.seconds = child.seconds

    def start(self) -> None:
        pass

    def exit_code(self) -> None:
        return None

    def stop(self) -> None:
        pass


class Engine:
    """An owner for `StepThreads.update` (which keeps a weak reference to it)."""


def test_steps_run_with_a_thread_fewer_while_any_background_child_compiles():
    """One thread fewer (never below one) while any engine's child compiles, not one a child; the
    count back once the last has ended, also in a thread that stepped lowered and steps again
    later, and after an engine dropped while its child ran; every thread for a compile here."""
    before = torch.get_num_threads()
    full = max(2, before)
    torch.set_num_threads(full)
    threads, first, second = StepThreads(), Engine(), Engine()
    seen = []

    def in_another_thread(step) -> None:
        def run():
            step()
            seen.append(torch.get_num_threads())
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()

    try:
        threads.update(first, True)
        threads.update(second, True)
        assert torch.get_num_threads() == full - 1 and threads.full_threads() == full
        with threads.all_threads():
            assert torch.get_num_threads() == full
        assert torch.get_num_threads() == full - 1
        in_another_thread(lambda: threads.update(first, True))
        threads.update(first, False)
        assert torch.get_num_threads() == full - 1  # the second child still compiles
        threads.update(second, False)
        assert torch.get_num_threads() == full
        in_another_thread(threads.settle)  # its next step, after the last child ended
        assert seen == [full - 1, full]

        dropped = Engine()
        threads.update(dropped, True)
        assert torch.get_num_threads() == full - 1
        del dropped
        gc.collect()
        threads.settle()
        assert torch.get_num_threads() == full
    finally:
        torch.set_num_threads(before)


def test_an_idle_engine_whose_child_ended_keeps_no_other_engine_a_thread_short():
    """Engine A's child ends while A is idle (A does not step again): engine B's next step, in
    the thread A lowered, has every thread back; and a thread lowered by a compile that ended
    with its engine dropped keys graphs by the full count, not the lowered one."""
    before = torch.get_num_threads()
    full = max(2, before)
    torch.set_num_threads(full)
    threads, idle, other = StepThreads(), Engine(), Engine()
    child = {"running": True}
    try:
        threads.update(idle, True, still_compiling=lambda: child["running"])
        assert torch.get_num_threads() == full - 1
        child["running"] = False
        threads.settle()  # a blocking engine's step (it has no child)
        assert torch.get_num_threads() == full
        threads.update(idle, True, still_compiling=lambda: child["running"])  # (a stale answer)
        threads.update(other, False)  # a background engine's step whose child has ended
        assert torch.get_num_threads() == full

        dropped = Engine()
        threads.update(dropped, True)
        del dropped
        gc.collect()
        assert torch.get_num_threads() == full - 1  # (settles at this thread's next step)
        assert threads.full_threads() == full
    finally:
        torch.set_num_threads(before)


def test_an_engine_dropped_during_a_locked_call_is_forgotten_without_a_deadlock():
    """The finalizer of an engine dropped while its child ran may run inside a garbage collection
    that an allocation under StepThreads' lock set off, in the thread that holds the lock."""
    threads, done = StepThreads(), threading.Event()

    def forget_under_the_lock():
        with threads._lock:
            threads._forget(1)
        done.set()

    worker = threading.Thread(target=forget_under_the_lock, daemon=True)
    worker.start()
    worker.join(5)
    assert done.is_set(), "the finalizer waited on the lock its own thread holds"


@pytest.mark.parametrize("max_model_len", [4, 10, 4096])
def test_the_background_childs_requests_fit_the_engines_max_model_len(max_model_len, tmp_path):
    """A short max_model_len refused the child's requests, and no graph was ever built."""
    from types import SimpleNamespace

    from fastgen.engine.compile_worker import build_every_graph

    asked = []

    def add_request(prompt, params):
        assert len(prompt) + params.max_tokens <= max_model_len
        asked.append((len(prompt), params.max_tokens))

    compiled = SimpleNamespace(needed={"layers"}, only=None, paths={"layers": tmp_path / "never-saved"})
    engine = SimpleNamespace(config=SimpleNamespace(max_model_len=max_model_len,
                                                    model_config=SimpleNamespace(vocab_size=384)),
                             runner=SimpleNamespace(compiled_decode=compiled), add_request=add_request,
                             has_unfinished_requests=lambda: False)
    assert build_every_graph(engine) == {"layers"}
    assert len(asked) == 3 and all(prompt >= 2 and out >= 2 for prompt, out in asked)  # prefill, then decode


def test_a_background_compile_stopped_by_its_engine_is_no_failure(tiny_models, private_cache):
    llm = cpu_llm(tiny_models["qwen3"], "background")
    compiled = llm.engine.runner.compiled_decode
    llm.engine.shutdown()  # stops the child mid-compile
    assert compiled.background.exit_code() is not None and compiled.background.stopped
    llm.generate(random_prompts([5], seed=75), GREEDY)
    assert compiled.failed == set()  # not marked failed: a later engine's child compiles them


def test_a_failed_background_compile_leaves_the_engine_eager_and_correct(tiny_models, reference, private_cache,
                                                                         monkeypatch, caplog):
    def broken(config, num_kv_blocks):  # a child that cannot build its engine
        spec = {"model": str(private_cache / "no-such-model"), "engine": {}, "threads": 1}
        return background_compile.BackgroundCompile(spec, private_cache / "background.log")

    monkeypatch.setattr(background_compile, "background_compile", broken)
    model = tiny_models["qwen3"]
    llm = cpu_llm(model, "background")
    compiled = llm.engine.runner.compiled_decode
    assert compiled.background.process.wait(timeout=120) != 0
    prompts = random_prompts([6, 10], seed=73) + random_prompts([4], seed=74)
    with caplog.at_level(logging.WARNING):
        assert_equal_transformers(reference, model, prompts, llm.generate(prompts, GREEDY))
    assert compiled.failed == {"layers"} and compiled.first_call_seconds == {}
    assert "the background compile ended (exit status 1" in caplog.text and "background.log" in caplog.text


class FakeChild:
    def __init__(self, graphs):
        self.spec, self.seconds, self.stopped, self.started = {"graphs": graphs}, 1.5, False, False

    def start(self):
        self.started = True

    def wait(self):
        return 0


@pytest.mark.parametrize(("processes", "cores", "shares"), [
    (None, 2, [["a", "b", "c"]]), (None, 16, [["a"], ["b"], ["c"]]), (None, 1, []), (2, 16, [["a", "b", "c"]]),
    (3, 2, [["a", "c"], ["b"]]), (8, 2, [["a"], ["b"], ["c"]]),
])
def test_helpers_share_the_graphs_among_the_processes_allowed(processes, cores, shares, monkeypatch):
    """One process a core by default (this one included); never more helpers than graphs."""
    monkeypatch.setattr(background_compile.os, "cpu_count", lambda: cores)
    made = []
    helpers = background_compile.CompileHelpers(lambda graphs: made.append(FakeChild(graphs)) or made[-1], processes)
    helpers.start(["a", "b", "c"])
    helpers.start(["d"])  # once only
    assert [child.spec["graphs"] for child in made] == shares and all(child.started for child in made)
    helpers.wait()
    assert helpers.seconds == ({"a": 1.5, "b": 1.5, "c": 1.5} if shares else {}) and helpers.children == []


def test_compile_mode_off_builds_no_compiled_steps(tiny_models):
    assert cpu_llm(tiny_models["qwen3"], "off").engine.runner.compiled_decode is None


def test_compile_mode_is_checked(tiny_models):
    with pytest.raises(ValueError, match="compile_mode='eager' is not one of"):
        cpu_llm(tiny_models["qwen3"], "eager")
