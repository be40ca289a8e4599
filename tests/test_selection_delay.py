"""Delayed selection (SFIConfig.selection_delay): the Selector runs in a background thread and its
selection is loaded a fixed number of fast steps after the slow step, on the real default model."""
import pytest

from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.stepper import SFIStepper
from sfi_gguf.tools.texts import natural_text

pytestmark = pytest.mark.real_model

N_CTX = 2048


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=N_CTX, n_threads=2)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenize(natural_text(8000, seed=3))[:1200]


def _generate(llm, prompt, config, n=64):
    llm.reset()  # fresh prefill: identical caches between the runs compared
    llm.sfi_config = config
    return llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)


def test_whole_context_budget_with_delay_equals_dense(llm, prompt):
    """Delayed or not, a selection of every cell must give dense's tokens: the memory in between
    (old selection + recent window moved past the slow step) must not drop a cell."""
    sfi = _generate(llm, prompt, SFIConfig(k_head=N_CTX, min_context=0, policy="fixed", fixed_period=8,
                                           selection_delay=5))
    dense = _generate(llm, prompt, SFIConfig(policy="dense"))
    assert sfi.tokens == dense.tokens
    s = sfi.stats.sfi
    assert s.n_async == s.n_slow > 0 and s.n_fell_back == 0


def test_every_memory_of_a_delayed_selection_holds_every_cell(llm, prompt, monkeypatch):
    """With a selection of every candidate, each memory loaded holds every cell of the context: the old
    selection with the recent window stretched to the slow step's token, and the new one `delay` steps later.
    Neither may drop the cells that entered the selection's range after it was chosen (they are nobody's
    candidates; a recent window of the last n_recent cells alone lost them, and the tokens stayed equal to
    dense on some CPUs only)."""
    import numpy as np

    from sfi_gguf.core.bindings import SFINative

    loads = []
    original = SFINative.set_selection

    def spy(self, cells, seq=0, shared=None):
        loads.append((len(llm.context.tokens), np.asarray(cells), np.asarray(shared)))
        return original(self, cells, seq, shared)

    monkeypatch.setattr(SFINative, "set_selection", spy)
    out = _generate(llm, prompt, SFIConfig(k_head=N_CTX, min_context=0, policy="fixed", fixed_period=8,
                                           selection_delay=5))
    assert out.stats.sfi.n_async >= 3 and len(loads) >= 2 * out.stats.sfi.n_async
    for n_context, cells, shared in loads:  # a fresh cache of one sequence: cell i holds position i
        for row in cells.reshape(-1, cells.shape[-1]):
            assert sorted(np.concatenate([row, shared]).tolist()) == list(range(n_context))


def test_the_longest_stretched_window_fits_the_native_capacity(llm, prompt, monkeypatch):
    """The memory between a slow step and its load keeps the old selection's whole recent window: its n_recent
    cells, the `delay` steps before that selection was loaded, the full tail since (a slow step skips the cheap
    refresh, so up to n_tail_max) and the slow step's token. A second slow step 257 steps after a delayed load
    is that longest case; the stretched window must lose no cell (each load's recent cells run unbroken to the
    newest, and the memory kept between a slow step and its load starts where the one before it started)."""
    import numpy as np

    from sfi_gguf.core.bindings import SFINative

    loads = []
    original = SFINative.set_selection

    def spy(self, cells, seq=0, shared=None):
        loads.append((len(llm.context.tokens), np.asarray(cells).copy(), np.sort(np.asarray(shared))))
        return original(self, cells, seq, shared)

    monkeypatch.setattr(SFINative, "set_selection", spy)
    config = SFIConfig(k_head=128, min_context=0, policy="fixed", fixed_period=257, selection_delay=5)
    out = _generate(llm, prompt, config, n=525)
    assert llm._sfi_native.params["n_tail_max"] == 256
    assert out.stats.sfi.slow_steps == [257, 519]
    starts = []
    for n_context, cells, shared in loads:  # a fresh cache of one sequence: cell i holds position i
        recent = shared[shared >= config.n_sink]
        assert np.array_equal(recent, np.arange(recent[0], n_context))
        starts.append(recent[0])
    kept = [i for i in range(1, len(loads)) if np.array_equal(loads[i][1], loads[i - 1][1])]
    assert len(kept) == 2 and all(starts[i] == starts[i - 1] for i in kept)
    assert n_context - starts[kept[-1]] == config.n_recent + 5 + 256 + 1  # the longest window, whole


def test_selection_is_loaded_exactly_delay_steps_after_its_slow_step(llm, prompt, monkeypatch):
    loads = []
    original = SFIStepper._use_selection

    def spy(self, selected, *args, **kwargs):
        loads.append(self._n_step)
        return original(self, selected, *args, **kwargs)

    monkeypatch.setattr(SFIStepper, "_use_selection", spy)
    config = SFIConfig(k_head=256, min_context=0, policy="fixed", fixed_period=12, selection_delay=5)
    first = _generate(llm, prompt, config)
    s = first.stats.sfi
    # the bootstrap is loaded at once (step 0); each slow step's selection before decoding step slow + 6,
    # and the period counts from there (the memory changes then); the last one, at 63, is still pending
    # when the generation ends and is dropped
    assert s.slow_steps == [12, 29, 46, 63]
    assert loads == [0, 18, 35, 52]
    assert s.t_selector_background > 0

    loads.clear()
    again = _generate(llm, prompt, config)
    assert again.tokens == first.tokens and again.stats.sfi.refresh_overlap == s.refresh_overlap


def test_selection_delay_is_validated():
    with pytest.raises(ValueError, match="selection_delay"):
        SFIConfig(selection_delay=-1)
