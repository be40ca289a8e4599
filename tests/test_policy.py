"""Trigger policies on hand-written token streams."""
import random

import numpy as np
import pytest

from sfi_gguf.core.boundary import PieceTable
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.policy import (
    POLICIES, DensePolicy, FixedPeriodPolicy, MemoryMode, PunctuationTmaxPolicy, SinkRecentPolicy, StaticPolicy,
    make_policy, policy_names, top1_probability,
)
from sfi_gguf.tools.bench import ReplayedConfidence

PIECES = ["Hello", " world", ".", " It", " is", " fine", "\n\n", "!", " ok", "?", " Yes", ".\n", " the", "3",
          "14", "\n", " end", "The", ".\n\n", "?\n\n", " a", "", " "]
TABLE = PieceTable(PIECES)
ID = {piece: i for i, piece in enumerate(PIECES)}


def ids(*pieces):
    return [ID[p] for p in pieces]


def punctuation(cooldown=2, min_gap=16, refresh_interval=64, sentence_offset=0, warmup_refresh=0,
                confidence_floor=0.0):
    """The punctuation policy; by default the paper's rule (no warm-up, no confidence trigger)."""
    policy = make_policy(SFIConfig(cooldown=cooldown, min_gap=min_gap, refresh_interval=refresh_interval,
                                   sentence_offset=sentence_offset, warmup_refresh=warmup_refresh,
                                   confidence_floor=confidence_floor), TABLE)
    policy.reset()  # the bootstrap refresh after prefill
    return policy


def slow_steps(policy, tokens):
    """Indices of the tokens whose decode step the policy makes slow."""
    return [i for i, token in enumerate(tokens) if policy.on_token(token)]


def test_the_slow_step_is_the_first_token_of_the_next_sentence():
    policy = punctuation(min_gap=0)
    stream = ids("Hello", " world", ".", " It", " is", " fine", ".\n\n", "\n", "The", " end", " is", "?", " Yes")
    assert slow_steps(policy, stream) == [3, 8, 12]
    assert policy.counts["sentence"] == 3


def test_enders_and_whitespace_after_an_ender_do_not_open_the_sentence():
    policy = punctuation(min_gap=0, cooldown=0)
    stream = ids(" ok", "?", "!", "\n\n", "", " ", "\n", " Yes", " ok")
    assert slow_steps(policy, stream) == [7]


def test_no_trigger_where_the_text_goes_on():
    policy = punctuation(min_gap=0, cooldown=0)
    stream = ids(" is", "3", ".", "14", " world", ".", " a", " end", "!", "\n", "The")  # 3.14; ". a" lowercase
    assert slow_steps(policy, stream) == [10]


def test_triggers_inside_the_minimum_gap_are_dropped():
    policy = punctuation(min_gap=16, cooldown=0)
    sentence = ids(" It", " is", " fine", ".")  # 4 tokens: sentence starts at steps 5, 9, 13, 17, ...
    fired = slow_steps(policy, ids(" ok") + sentence * 10)
    # sentence starts at tokens 5, 9, 13, ...; token i is step i + 1 after the refresh
    assert fired == [17, 33]
    assert policy.counts["sentence"] == 2
    assert policy.counts["dropped"] == 10 - 1 - 2  # every other sentence start but the first


def test_cooldown_ignores_enders_right_after_a_trigger():
    stream = ids(".", " Yes", ".", " It", " is", ".", " It")  # "Yes." ends one step after its trigger
    assert slow_steps(punctuation(min_gap=0, cooldown=2), stream) == [1, 6]
    assert slow_steps(punctuation(min_gap=0, cooldown=0), stream) == [1, 3, 6]
    # the cooldown is over after two tokens: an ender on the third arms again
    stream = ids(".", " Yes", " is", " ok", ".", " It")
    assert slow_steps(punctuation(min_gap=0, cooldown=2), stream) == [1, 5]


def test_cooldown_also_follows_a_dropped_trigger():
    policy = punctuation(min_gap=100, cooldown=2, refresh_interval=1000)
    stream = ids(".", " Yes", ".", " It")
    assert slow_steps(policy, stream) == []
    assert policy.counts["dropped"] == 1  # " It" was never armed: the "." came in the cooldown


def test_t_max_forces_a_slow_step_without_sentences():
    policy = punctuation(refresh_interval=64)
    fired = slow_steps(policy, ids(" is") * 200)
    assert fired == [63, 127, 191]  # the 64th step after each refresh
    assert policy.reason is None and policy.counts == {"interval": 3}
    policy.reset()
    assert policy.steps_since_refresh == 0
    assert slow_steps(policy, ids(" is") * 64) == [63]
    assert policy.reason == "interval"


def test_sentences_reset_the_t_max_count():
    policy = punctuation(min_gap=16, refresh_interval=20)
    stream = ids(" is") * 17 + ids(".", " It") + ids(" is") * 25
    assert slow_steps(policy, stream) == [18, 38]  # sentence at step 19, then 20 steps later: interval


def test_reset_forgets_a_pending_sentence_end():
    policy = punctuation(min_gap=0)
    assert slow_steps(policy, ids(" ok", ".")) == []
    policy.reset()
    assert slow_steps(policy, ids(" It", " is")) == []


def test_note_refresh_restarts_the_count_but_keeps_the_sentence_state():
    policy = punctuation(min_gap=0, cooldown=2, refresh_interval=10)
    assert slow_steps(policy, ids(" ok", ".", " It", " is")) == [2]
    policy.note_refresh()  # what a loop does after every selection: harmless after on_token's own
    assert policy.steps_since_refresh == 0
    assert slow_steps(policy, ids(".", " It")) == []  # still in the cooldown of the trigger at " It"
    assert slow_steps(policy, ids(" is") * 8) == [7]  # T_max counted from note_refresh


def test_reset_reads_the_context_without_triggering():
    policy = punctuation(min_gap=0)
    policy.reset(context=ids("Hello", ".", " It", " is", " fine", "."))  # the prompt ends a sentence
    assert policy.steps_since_refresh == 0 and not policy.counts
    assert slow_steps(policy, ids(" Yes", " ok")) == [0]


def test_matches_the_reference_trigger_on_random_text():
    """Same slow steps as the authors' id-based RefreshTrigger (transcribed below) on text where
    both agree on what a sentence is: capitalised starts, enders followed by whitespace."""
    enders = ids(".", "?", "!", ".\n", ".\n\n", "?\n\n")
    newlines = ids("\n", "\n\n")

    def reference(tokens, cooldown, min_gap, interval):
        state = dict(cooldown=0, awaiting=False, since=0)
        fired = []
        for i, token in enumerate(tokens):
            state["since"] += 1
            within_gap = min_gap > 0 and state["since"] < min_gap
            if state["cooldown"] == 0 and token in enders:  # _check_sentence_end
                state["cooldown"], state["awaiting"] = cooldown, True
            elif state["cooldown"] > 0:
                state["cooldown"] -= 1
            start = False
            if state["awaiting"] and token not in enders and token not in newlines:  # _check_sentence_start
                state["awaiting"], start = False, True
                state["cooldown"] = max(state["cooldown"], cooldown)
            if (start and not within_gap) or state["since"] >= interval:  # + the step-time interval planner
                state["since"] = 0
                fired.append(i)
        return fired

    rng = random.Random(0)
    for trial in range(40):
        tokens = []
        while len(tokens) < 400:
            tokens.append(ID[rng.choice([" It", " Yes", "The", "Hello"] if tokens and PIECES[tokens[-1]].endswith("\n")
                                        else [" It", " Yes"])])
            tokens += ids(*rng.choices([" is", " fine", " ok", " the", " world"], k=rng.randrange(0, 7)))
            tokens.append(ID[rng.choice([".", "?", "!", ".\n", ".\n\n", "?\n\n"])])
            tokens += ids(*rng.choices(["\n", "\n\n"], k=rng.choice([0, 0, 1, 2])))
        cooldown, min_gap, interval = rng.choice([(2, 16, 64), (2, 0, 64), (0, 4, 10), (3, 8, 24)])
        ours = slow_steps(punctuation(cooldown, min_gap, interval), tokens)
        assert ours == reference(tokens, cooldown, min_gap, interval), (trial, cooldown, min_gap, interval)


def test_fixed_period():
    policy = make_policy(SFIConfig(policy="fixed", fixed_period=10))
    assert isinstance(policy, FixedPeriodPolicy) and policy.memory is MemoryMode.SELECTED and policy.bootstrap
    policy.reset()
    assert slow_steps(policy, ids(".", " It") * 15) == [9, 19, 29]
    assert policy.reason == "period" and policy.counts == {"period": 3}


@pytest.mark.parametrize("name,cls,memory,bootstrap", [
    ("static", StaticPolicy, MemoryMode.SELECTED, True),
    ("sink_recent", SinkRecentPolicy, MemoryMode.SINK_RECENT, False),
    ("dense", DensePolicy, MemoryMode.DENSE, False),
])
def test_policies_that_never_refresh(name, cls, memory, bootstrap):
    policy = make_policy(SFIConfig(policy=name), TABLE)
    assert isinstance(policy, cls) and policy.memory is memory and policy.bootstrap is bootstrap
    policy.reset()
    assert slow_steps(policy, ids(".", " It", " is") * 100) == []


def test_registry():
    assert set(policy_names()) == set(POLICIES) == {"punctuation", "fixed", "static", "sink_recent", "dense"}
    assert isinstance(make_policy(SFIConfig(), PIECES), PunctuationTmaxPolicy)  # raw pieces are accepted too
    assert isinstance(make_policy(SFIConfig(), TABLE, name="dense"), DensePolicy)
    policy = make_policy(SFIConfig(cooldown=3, min_gap=8, refresh_interval=32, sentence_offset=1, warmup_refresh=5),
                         TABLE)
    assert (policy.cooldown, policy.min_gap, policy.refresh_interval) == (3, 8, 32)
    assert (policy.sentence_offset, policy.warmup) == (1, 5)
    with pytest.raises(ValueError, match="unknown trigger policy"):
        make_policy(SFIConfig(), TABLE, name="sometimes")
    with pytest.raises(ValueError, match="token pieces"):
        make_policy(SFIConfig())
    for cls in POLICIES.values():
        assert cls.summary() and "\n" not in cls.summary()


def test_sentence_offset_delays_the_trigger_into_the_sentence():
    stream = ids("Hello", " world", ".", " It", " is", " fine", ".\n\n", "\n", "The", " end", " is", "?", " Yes", " ok",
                 " the", " end")
    assert slow_steps(punctuation(min_gap=0), stream) == [3, 8, 12]
    assert slow_steps(punctuation(min_gap=0, sentence_offset=2), stream) == [5, 10, 14]
    policy = punctuation(min_gap=0, sentence_offset=1)
    assert slow_steps(policy, stream) == [4, 9, 13]
    assert policy.counts == {"sentence": 3}


def test_sentence_offset_keeps_the_minimum_gap_of_the_opening_token():
    # the sentence opens at step 3 (inside a gap of 4) and is dropped, though step 3 + 2 is past the gap
    policy = punctuation(min_gap=4, sentence_offset=2, refresh_interval=1000)
    assert slow_steps(policy, ids(" ok", ".", " It", " is", " fine", " the", " end")) == []
    assert policy.counts["dropped"] == 1


def test_the_interval_cancels_a_pending_sentence_trigger():
    # the sentence opens at step 5 (index 4): due at index 7, but T_max = 6 fires at index 5 first
    policy = punctuation(min_gap=0, sentence_offset=3, refresh_interval=6)
    fired = slow_steps(policy, ids(" ok", " is", " fine", ".", " It", " is", " fine", " the", " end", " a"))
    assert fired == [5] and policy.counts == {"interval": 1}


def test_warmup_refresh_once_after_the_bootstrap():
    policy = punctuation(min_gap=16, warmup_refresh=8, refresh_interval=64)
    stream = ids(" is") * 100
    assert slow_steps(policy, stream) == [7, 71]  # token i is step i + 1 after the bootstrap
    assert policy.counts == {"warmup": 1, "interval": 1}
    policy.reset()  # new text: a new bootstrap, a new warm-up
    assert slow_steps(policy, stream[:20]) == [7]


def test_warmup_is_skipped_when_another_refresh_came_first():
    policy = punctuation(min_gap=0, cooldown=0, warmup_refresh=8, refresh_interval=64)
    assert slow_steps(policy, ids(".", " It") + ids(" is") * 20) == [1]
    assert policy.counts == {"sentence": 1}


def test_low_confidence_forces_a_slow_step_after_the_minimum_gap():
    policy = punctuation(min_gap=4, warmup_refresh=0, confidence_floor=0.5, refresh_interval=64)
    assert policy.reads_confidence and not punctuation().reads_confidence
    sure, unsure = 0.9, 0.3
    confidences = [sure, unsure, unsure, sure, unsure, unsure, sure, sure, unsure, unsure, unsure, unsure]
    fired = []
    for i, top1 in enumerate(confidences):
        policy.observe_confidence(top1)
        if policy.on_token(ID[" is"]):
            fired.append(i)
    # steps 1..4 are inside the gap; step 5 (index 4) is unsure and past it; then again 4 steps later
    assert fired == [4, 8] and policy.counts == {"confidence": 2}
    policy.reset()
    assert policy.confidence == 1.0  # a new text starts sure


def test_confidence_is_wanted_only_past_the_minimum_gap_and_counts_for_one_token():
    policy = punctuation(min_gap=4, warmup_refresh=0, confidence_floor=0.5, refresh_interval=64)
    wanted = []
    for _ in range(6):
        wanted.append(policy.wants_confidence())
        policy.on_token(ID[" is"])
    assert wanted == [False, False, False, True, True, True]  # the 4th token is the first past the gap
    policy.observe_confidence(0.1)
    assert policy.on_token(ID[" is"]) and policy.reason == "confidence"
    assert not policy.wants_confidence()  # a refresh: inside the gap again
    policy.observe_confidence(0.1)        # read by nothing (inside the gap) ...
    for _ in range(6):
        assert not policy.on_token(ID[" is"])  # ... and not kept for the tokens after it
    assert not punctuation(confidence_floor=0.0).wants_confidence()


def test_a_replayed_trace_decides_the_confidence_refreshes_whatever_the_model_says():
    trace = [0.9] * 5 + [0.2] + [0.9] * 6 + [0.3] + [0.9] * 3   # unsure at tokens 5 and 12
    policy = ReplayedConfidence(punctuation(min_gap=4, confidence_floor=0.5), trace)
    fired = []
    for round_ in range(2):  # a reset starts the trace again
        policy.reset()
        fired.append([])
        for i in range(len(trace)):
            if policy.wants_confidence():
                policy.observe_confidence(0.01)  # the benchmarked model: never sure
            if policy.on_token(ID[" is"]):
                fired[-1].append((i, policy.reason))
    assert fired == [[(5, "confidence"), (12, "confidence")]] * 2
    assert policy.counts == {"confidence": 4} and policy.min_gap == 4  # the rest is the wrapped policy's
    with pytest.raises(ValueError, match="covers 16 tokens"):
        for _ in range(8):
            policy.observe_confidence(0.5)
            policy.on_token(ID[" is"])


def test_top1_probability():
    assert top1_probability(np.zeros(4)) == pytest.approx(0.25)
    assert top1_probability(np.array([0.0, 100.0, 0.0], np.float32)) == pytest.approx(1.0)
    assert top1_probability(np.log(np.array([0.2, 0.5, 0.3]))) == pytest.approx(0.5)


def test_default_punctuation_policy_has_the_warmup_and_the_confidence_trigger():
    policy = make_policy(SFIConfig(), TABLE)
    assert (policy.cooldown, policy.min_gap, policy.refresh_interval, policy.sentence_offset, policy.warmup,
            policy.confidence_floor) == (2, 16, 64, 0, 8, 0.5)
    assert policy.reads_confidence
