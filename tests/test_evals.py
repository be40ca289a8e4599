"""Quality evaluation (sfi_gguf.tools.evals): case generation and scoring without a model, then the
`--quick` suite end to end on the default model (CI: about two minutes on 2 CPU cores)."""
import json
import re

import pytest

from sfi_gguf.tools.evals import common, cot, longgen, needle, variables
from sfi_gguf.tools.evals.report import markdown_table
from sfi_gguf.tools.evals.runner import POLICIES, aggregate, k_head_for


class WordTokenizer:
    """Stands in for SFILlama where only token counts matter (one token per word)."""

    def tokenize(self, text, add_special=True):
        return text.split()


# -- without a model ------------------------------------------------------------------------------------
def test_needle_cases_are_reproducible_and_span_the_depths():
    llm = WordTokenizer()
    a = needle.make_cases(llm, 1500, 5, seed=3)
    b = needle.make_cases(llm, 1500, 5, seed=3)
    assert [c.document for c in a] == [c.document for c in b]
    depths = [c.meta["depth"] for c in a]
    assert depths == sorted(depths, reverse=True)  # deepest first: consecutive cases share a long prefix
    assert depths[0] == pytest.approx(0.9, abs=0.03) and depths[-1] == pytest.approx(0.1, abs=0.03)
    for case in a:
        assert needle.fact(case.meta["key"], case.expected[0]) in case.document
        assert len(case.document.split()) <= 1500
        for key, value in case.meta["distractors"].items():
            assert key != case.meta["key"] and value in case.document
    assert needle.make_cases(llm, 1500, 5, seed=4)[0].expected != a[0].expected  # new seed, new cases


def test_needle_scoring_is_exact_match_of_the_number():
    case = needle.make_cases(WordTokenizer(), 800, 1)[0]
    value = case.expected[0]
    assert needle.score(case, f" {value}.") == 1.0
    assert needle.score(case, f" {value[:-1]}.") == 0.0
    assert needle.score(case, f" {value}1") == 0.0


def test_variable_chains_are_in_order_and_scored_hop_by_hop():
    llm = WordTokenizer()
    (case,) = variables.make_cases(llm, 1500, 1, n_hops=3)
    assert variables.make_cases(llm, 1500, 1, n_hops=3)[0].document == case.document  # seeded
    names = case.meta["names"]
    assert len(names) == 4 and case.answer_prefix == f"VAR {names[-1]} ="
    assert case.expected == (names[2], names[1], names[0], case.meta["value"])
    first = case.document.index(f"VAR {names[0]} = {case.meta['value']}.")
    for before, name in zip(names, names[1:]):
        at = case.document.index(f"VAR {name} = VAR {before}.")
        assert at > first
        first = at
    assert str(case.meta["distractor_value"]) in case.document
    full = f" VAR {names[2]} = VAR {names[1]} = VAR {names[0]} = {case.meta['value']}"
    assert variables.score(case, full) == 1.0
    assert variables.score(case, f" {case.meta['value']}") == 1.0  # the value without the names counts
    assert variables.score(case, f" VAR {names[2]} = VAR {names[1]} = VAR XXXXX =") == 0.5
    assert variables.score(case, f" VAR {names[1]} = VAR {names[2]} =") == 0.0  # hops out of order
    assert variables.score(case, f" VAR {names[2]} = {case.meta['distractor_value']}") == 0.25


def test_cot_cases_have_computed_answers_and_are_seeded():
    cases = cot.make_cases(None, 16)
    assert len({c.meta["problem"] for c in cases}) == 16
    assert [c.meta["problem"] for c in cot.make_cases(None, 16)] == [c.meta["problem"] for c in cases]
    assert [c.meta["problem"] for c in cot.make_cases(None, 16, seed=1)] != [c.meta["problem"] for c in cases]
    for i, case in enumerate(cases):  # every template in turn, its answer computed from the numbers in the text
        template, solve, *_ = cot.TEMPLATES[i % len(cot.TEMPLATES)]
        numbers = [int(n) for n in re.findall(r"\d+", case.meta["problem"])]
        a, b, c = numbers  # the templates name a, b, c in this order
        assert len(set(numbers)) == 3 and case.meta["problem"] == template.format(a=a, b=b, c=c)
        assert case.expected == (str(solve(a, b, c)),)
        assert int(case.expected[0]) > 0 and case.max_tokens >= 256
    assert cot.score(cases[0], f"So it is 5 + 2 = 7. The answer is {cases[0].expected[0]}.") == 1.0
    assert cot.score(cases[0], f"The answer is \\(\\boxed{{{cases[0].expected[0]}}}\\).") == 1.0
    assert cot.score(cases[0], "The answer is -1.") == 0.0


def test_longgen_reference_is_the_text_that_follows_the_prompt():
    llm = WordTokenizer()
    (case,) = longgen.make_cases(llm, 300, 1, n_steps=200)
    assert longgen.make_cases(llm, 300, 1, n_steps=200)[0].document == case.document  # seeded
    prompt, reference = longgen.prompt_tokens(llm, case), longgen.reference_tokens(llm, case)
    assert len(prompt) == 300 and len(reference) == 200 == case.max_tokens
    assert prompt + reference == llm.tokenize(case.document)[:500]  # held-out natural text, not a generation
    short = common.Case(task="longgen", case_id="x", context=300, document="a b c", question="", max_tokens=200)
    with pytest.raises(ValueError):
        longgen.reference_tokens(llm, short)


def test_insert_at_depths_places_facts_between_sentences():
    sentences = [f"Sentence {i} is here." for i in range(10)]
    text, realised = common.insert_at_depths(sentences, [(0.5, "FACT A."), (0.0, "FACT B.")])
    assert text.startswith("FACT B. Sentence 0") and "here. FACT A. Sentence 5" in text
    assert realised == [pytest.approx(0.5), 0.0]


def test_budget_and_table():
    assert k_head_for(2048, 0.125) == 256 and k_head_for(16384, 0.125) == 2048 and k_head_for(300, 0.125) == 64
    records = [{"model": "m.gguf", "task": "needle", "context": 1024, "case_id": str(i), "policy": p,
                "prompt_tokens": 1000, "k_head": 128, "n_sink": 4, "n_recent": 64, "budget_share": 0.196,
                "score": float(i == 0 or p == "dense"), "commit": "abc"} for i in range(2) for p in POLICIES]
    rows = aggregate(records)
    assert [r["policy"] for r in rows] == list(POLICIES)
    assert rows[0]["score"] == 1.0 and rows[1]["score"] == 0.5 and rows[0]["n_cases"] == 2
    table = markdown_table(rows)
    assert "| m | needle | 1024 | 128 | 20% | 2 | 100.0 | 50.0 |" in table


# -- the quick suite on the default model ----------------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.slow
def test_quick_suite_runs_every_policy_and_dense_solves_the_needles(tmp_path):
    from sfi_gguf.tools.evals import run_suite

    out = tmp_path / "eval-quick.json"
    data = run_suite("quick", out, n_threads=2)
    rows, records = data["rows"], data["records"]
    assert json.loads(out.read_text())["rows"] == rows
    for row in rows:
        for key in ("model", "policy", "task", "context", "k_head", "budget_share", "n_cases", "score", "commit"):
            assert key in row
        assert 0.0 <= row["score"] <= 1.0 and row["budget_share"] < 0.5
    assert {r["task"] for r in rows} == {"needle", "variables", "longgen", "cot"}
    assert {r["policy"] for r in rows} == set(POLICIES)
    dense_needles = [r for r in records if r["task"] == "needle" and r["policy"] == "dense"]
    assert len(dense_needles) == 2 and all(r["score"] == 1.0 for r in dense_needles)
    # one prefill per case: later policies decode only the prompt's last n_prefill_queries tokens again
    # (variables: one generation per hop, each on the cached prompt plus the answer so far)
    for r in records:
        if r["task"] in ("needle", "variables", "cot") and r["policy"] != "dense":
            limit = 32 * (len(r["expected"]) + 1) if r["task"] == "variables" else 16
            assert r["n_prompt_decoded"] <= limit, r
    longgen = [r for r in records if r["task"] == "longgen" and r["policy"] == "punctuation"]
    assert len(longgen) == 1 and len(longgen[0]["top1_bits"]) == 64 and longgen[0]["per_100"]
    # teacher-forced through held-out text, not dense's own greedy continuation (that would give dense 1.0)
    dense_longgen = [r for r in records if r["task"] == "longgen" and r["policy"] == "dense"]
    assert 0.0 < dense_longgen[0]["text_top1"] < 0.9 and "text_top1" in longgen[0]
    # resume: a second run with the same file finds every record done
    again = run_suite("quick", out, n_threads=2)
    assert len(again["records"]) == len(records) and again["rows"] == rows


@pytest.mark.real_model
def test_prompt_cache_is_trimmed_back_after_an_sfi_generation():
    """Dense after SFI (which decoded and cached its own tokens) equals dense from a fresh prefill."""
    from sfi_gguf import SFILlama
    from sfi_gguf.core.config import SFIConfig

    llm = SFILlama(None, n_ctx=1024, n_threads=2)
    try:
        case = needle.make_cases(llm, 640, 1)[0]
        tokens = common.prompt_tokens(llm, case)
        llm.sfi_config = SFIConfig(policy="dense")
        fresh = llm.generate(tokens, max_tokens=12, temperature=0)
        llm.sfi_config = SFIConfig(policy="punctuation", k_head=64, n_recent=64)
        sfi = llm.generate(tokens, max_tokens=12, temperature=0, ignore_eos=True)
        assert sfi.stats.n_prompt_decoded == 16 and sfi.stats.sfi.n_bootstrap == 1 and sfi.stats.sfi.n_fast > 0
        llm.sfi_config = SFIConfig(policy="dense")
        again = llm.generate(tokens, max_tokens=12, temperature=0)
        assert again.stats.n_prompt_decoded == 16 and again.tokens == fresh.tokens
    finally:
        llm.close()
