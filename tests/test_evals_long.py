"""The long-answer evaluation tasks (multi-fact, chain, reasoning, answer agreement on one shared
document): documents and scorers without a model, then a tiny run of all four on the default model."""
import re

import numpy as np
import pytest

from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.context import LlamaContext
from sfi_gguf.tools.evals import answer_agreement, chain, long_tasks, longdoc, multifact, reasoning
from sfi_gguf.tools.evals.report import cadence_table, markdown_table
from sfi_gguf.tools.evals.runner import (LONG_TASKS, SUITES, Suite, TaskPlan, aggregate, context_size, policy_config,
                                         run_suite)


class WordTokenizer:
    """Stands in for SFILlama where only token counts matter (one token per word)."""

    def tokenize(self, text, add_special=True):
        return text.split()


LLM = WordTokenizer()


def test_the_tasks_share_one_seeded_document_holding_every_plant():
    by_task = {m.TASK: long_tasks.make_cases(m.TASK, LLM, 3000, 2) for m in LONG_TASKS}
    for i in range(2):
        docs = {cases[i].document for cases in by_task.values()}
        assert len(docs) == 1  # one prefill serves every task of a case
        (doc,) = docs
        assert len(doc.split()) <= 3000 - longdoc.RESERVE
        for key, code in by_task["multifact"][i].meta["codes"].items():
            assert multifact.fact(key, code) in doc
        assert f"VAR {by_task['chain'][i].meta['names'][0]} = {by_task['chain'][i].meta['value']}." in doc
        for n in by_task["reasoning"][i].meta["numbers"]:
            assert f" {n} " in doc
    assert by_task["multifact"][0].document != by_task["multifact"][1].document
    again = long_tasks.make_cases(multifact.TASK, LLM, 3000, 2)
    assert [c.document for c in again] == [c.document for c in by_task["multifact"]]  # seeded
    assert long_tasks.make_cases(multifact.TASK, LLM, 3000, 1, seed=1)[0].document != again[0].document
    assert long_tasks.make_cases(multifact.TASK, LLM, 3000, 1, max_tokens=10)[0].max_tokens == 10


def test_multifact_facts_are_spread_and_scored_per_fact():
    (case,) = long_tasks.make_cases(multifact.TASK, LLM, 4000, 1)
    depths = case.meta["depths"]
    assert len(depths) == multifact.N_FACTS and depths == sorted(depths)
    assert depths[0] < 1 / multifact.N_FACTS and depths[-1] > 1 - 1 / multifact.N_FACTS  # one per slice
    keys, codes = case.meta["keys"], case.meta["codes"]
    assert case.answer_prefix == f"{keys[0]}:" and case.expected == tuple(codes[k] for k in keys)
    right = "".join(f"\n{k}: {codes[k]}" for k in keys)[len(case.answer_prefix) + 1:]
    assert multifact.score(case, right) == 1.0
    half = right.replace(codes[keys[1]], "1111111").replace(codes[keys[2]], "2222222").replace(codes[keys[3]], "")
    assert multifact.score(case, half) == pytest.approx(0.5)
    swapped = right.replace(codes[keys[0]], "X").replace(codes[keys[1]], codes[keys[0]]).replace("X", codes[keys[1]])
    assert multifact.score(case, swapped) == pytest.approx(4 / 6)  # a code on another key's line is wrong
    assert multifact.score(case, " 1234567") == 0.0


def test_chain_is_scored_hop_by_hop():
    (case,) = long_tasks.make_cases(chain.TASK, LLM, 4000, 1)
    names, value = case.meta["names"], case.meta["value"]
    assert len(names) == chain.N_HOPS + 1 and case.answer_prefix == f"VAR {names[-1]} = VAR"
    assert case.meta["distractor_value"] in case.document
    b, a, first = names[2], names[1], names[0]
    assert chain.score(case, f" {b} = VAR {a} = VAR {first} = {value}") == 1.0
    assert chain.score(case, f" VAR {b} = VAR {a} = VAR XXXXX = 99999") == 0.5
    assert chain.score(case, f" VAR {b} = VAR {first} = {value}") == 0.5  # a skipped hop, the value right
    assert chain.score(case, f" {value}") == 0.25
    assert chain.score(case, f" VAR {a} = VAR {b}") == 0.0


def test_reasoning_numbers_lie_far_apart_and_the_answer_is_computed():
    cases = long_tasks.make_cases(reasoning.TASK, LLM, 4000, 4)
    for case in cases:
        d = case.meta["depths"]
        assert len(d) == 3 and d[0] < 0.35 and 0.35 < d[1] < 0.65 and d[2] > 0.65
        a, b, c = case.meta["numbers"]
        assert case.meta["subject"] in case.question
        assert not any(re.search(rf"\b{n}\b", case.question) for n in (a, b, c))  # to be read from the document
        template = next(t for t in reasoning.TEMPLATES if t[0][0].format(name=case.meta["subject"], a=a, b=b, c=c)
                        in case.document)
        assert case.expected == (str(template[2](a, b, c)),)
    case = cases[0]
    assert reasoning.score(case, f"So 3 + 4 = 7. The answer is {case.expected[0]}.") == 1.0
    assert reasoning.score(case, "The answer is 0.") == 0.0


def test_reasoning_gives_its_worked_example_as_an_earlier_chat_turn():
    """Inside the question the worked example was what the models answered: it is the first user turn's end (after
    the document, which opens every long task's prompt) with its answer as the assistant's turn, then the problem."""
    class ChatLLM(WordTokenizer):
        class context:
            chat_template = staticmethod(lambda: "chatml")

        def prompt_tokens(self, messages):
            self.messages = messages
            return [m["role"] for m in messages]

    llm = ChatLLM()
    case = long_tasks.make_cases(reasoning.TASK, LLM, 3000, 1)[0]
    tokens = reasoning.prompt_tokens(llm, case)
    first, answer, problem = llm.messages
    assert first["role"] == "user" and first["content"].startswith(case.document)
    assert reasoning.EXAMPLE[0] in first["content"] and "45" not in case.question
    assert answer == {"role": "assistant", "content": reasoning.EXAMPLE[1]} and answer["content"].endswith("is 57.")
    assert problem == {"role": "user", "content": case.question}
    assert tokens == ["user", "assistant", "user"] + case.answer_prefix.split()


def test_agreement_first_divergence():
    assert answer_agreement.first_divergence(np.array([True, True, False, True])) == 2
    assert answer_agreement.first_divergence(np.array([True, True])) == 2
    assert answer_agreement.first_divergence(np.array([False])) == 0


def test_budgets_variants_and_table():
    plan = TaskPlan(budgets=(2048, 0.125))
    assert plan.k_heads(8192) == [2048, 1024] and plan.k_heads(16384) == [2048]  # coinciding budgets run once
    paper = policy_config("paper", 512, 256)
    assert paper.policy == "punctuation" and paper.policy_params.confidence_floor == 0
    assert paper.policy_params.warmup_refresh == policy_config("punctuation", 512, 256).policy_params.warmup_refresh
    assert policy_config("fixed16", 512, 256).policy_params.fixed_period == 16
    recent = policy_config("recent512", 2048, 256)  # the same budget, 256 cells moved from k_head to the window
    assert (recent.n_recent, recent.k_head, recent.policy) == (512, 1792, "punctuation")
    assert policy_config("interval32", 2048, 256).policy_params.refresh_interval == 32
    both = policy_config("redecode_interval32", 2048, 256)
    assert both.redecode_tail and both.policy_params.refresh_interval == 32 and both.k_head == 2048
    window = policy_config("redecode_recent512", 2048, 256)
    assert window.redecode_tail and (window.n_recent, window.k_head) == (512, 1792)
    with pytest.raises(ValueError, match="recent512"):
        policy_config("recent512", 128, 64)
    records = [{"model": "m.gguf", "task": "agreement", "context": 8192, "case_id": "0", "policy": p,
                "prompt_tokens": 7700, "k_head": k, "n_sink": 4, "n_recent": 256, "budget_share": 0.3,
                "score": 1.0 if p == "dense" else k / 4096, "mean_kl": 0.1, "first_divergence": 9,
                "commit": "abc"} for k in (2048, 1024) for p in ("dense", "paper", "punctuation")]
    rows = aggregate(records)
    assert [(r["k_head"], r["policy"]) for r in rows] == [(2048, "dense"), (2048, "punctuation"), (2048, "paper"),
                                                           (1024, "dense"), (1024, "punctuation"), (1024, "paper")]
    table = markdown_table(rows)
    assert "| m | agreement | 8192 | 2048 | 30% | 1 | 100.0 | 50.0 / 0.100 / 9 | 50.0 / 0.100 / 9 |" in table
    assert "| m | agreement | 8192 | 1024 | 30% | 1 | 100.0 | 25.0 / 0.100 / 9 | 25.0 / 0.100 / 9 |" in table
    for r in records:
        r["n_generated"], r["sfi"] = 200, {"n_slow": 8 if r["policy"] == "paper" else 14}
    records.append({**records[1], "n_generated": 10, "sfi": {"n_slow": 5}})  # a short answer: not counted
    cadence = cadence_table(records)
    assert "| m | 8192 | 1024 | 7.0 | 4.0 |" in cadence and "| m | 8192 | 2048 | 7.0 | 4.0 |" in cadence


# -- a tiny run on the default model -------------------------------------------------------------------
@pytest.mark.real_model
def test_the_long_suite_fits_the_default_models_training_context():
    """A long task's document leaves room for its question and answer inside its context, so the 32K cells need
    no more than the default model's 32K training context; other tasks' prompts take the context itself."""
    plans = SUITES["long"].models["qwen2.5-coder-0.5b-instruct"]
    assert context_size(plans) == 32768
    # the 1.5B model, of the same 32K training context
    assert context_size(SUITES["long"].models["qwen2.5-coder-1.5b-instruct"]) == 32768
    assert context_size({"agreement": TaskPlan(contexts=(8192,))}) == 8192
    assert context_size({"needle": TaskPlan(contexts=(16384,))}) == 16384 + 256
    assert context_size({"longgen": TaskPlan(contexts=(3072,), options={"n_steps": 1024})}) == 3072 + 256 + 1024


@pytest.mark.real_model
def test_tiny_long_suite_runs_every_task_with_one_prefill_per_document(tmp_path):
    suite = Suite(models={"qwen2.5-coder-0.5b-instruct": {
        m.TASK: TaskPlan(contexts=(1024,), n_cases=1, n_recent=64, budgets=(128, 64), options={"max_tokens": 12})
        for m in LONG_TASKS}}, policies=("dense", "punctuation", "paper"))
    out = tmp_path / "long.json"
    data = run_suite(suite, out, n_threads=2, case_cache=tmp_path / "cases")
    records = data["records"]
    assert {r["task"] for r in records} == {m.TASK for m in LONG_TASKS}
    for task in (m.TASK for m in LONG_TASKS):
        got = {(r["policy"], r["k_head"]) for r in records if r["task"] == task}
        assert got == {(p, k) for p in ("dense", "punctuation", "paper") for k in (128, 64)}
    for r in records:
        assert 0.0 <= r["score"] <= 1.0
        if r["policy"] != "dense":  # the document's prefill was reused: only the bootstrap rows decoded
            assert r["sfi"]["n_bootstrap"] == 1 and r["sfi"]["k_head"] == r["k_head"]
    dense = [r for r in records if r["task"] == "agreement" and r["policy"] == "dense"]
    assert len(dense) == 2 and dense[0]["text"] == dense[1]["text"]  # one dense answer, recorded at each budget
    forced = [r for r in records if r["task"] == "agreement" and r["policy"] != "dense"]
    assert all(len(r["top1_bits"]) == r["n_generated"] <= 12 and 0 <= r["first_divergence"] <= 12 for r in forced)
    again = run_suite(suite, out, n_threads=2, case_cache=False)  # resume: nothing left to run
    assert len(again["records"]) == len(records)
    # one of the budgets only (`sfi-gguf eval --k-head`)
    one = run_suite(suite, tmp_path / "one-budget.json", tasks=["agreement"], policies=["dense", "punctuation"],
                    k_heads=[64], n_threads=2, case_cache=False)
    assert {(r["policy"], r["k_head"]) for r in one["records"]} == {("dense", 64), ("punctuation", 64)}


# -- the case cache, on a random-weight model ----------------------------------------------------------
def test_a_later_run_loads_each_cases_prompt_and_dense_answer_and_gives_the_records_of_a_run_without(
        tmp_path, tiny_path, monkeypatch):
    """The first run keeps each long case's prefilled prompt (llama.cpp's sequence state) and dense's answer; a
    later run adding policies loads both, decodes only the prompt's last rows (the bootstrap's), and its records are
    those of a run without the cache: a loaded state serves SFI as a fresh prefill does."""
    suite = Suite(models={str(tiny_path): {
        m.TASK: TaskPlan(contexts=(1536,), n_cases=2, n_recent=32, budgets=(64,), options={"max_tokens": 48})
        for m in (multifact, answer_agreement)}})
    cache, out = tmp_path / "cases", tmp_path / "cached.json"
    run_suite(suite, out, policies=["dense", "punctuation"], n_threads=1, case_cache=cache, log=None)
    assert len(list(cache.glob("*.state"))) == 4 and len(list(cache.glob("*.npz"))) == 2  # agreement's answers

    decoded = []
    prefill = LlamaContext.prefill
    monkeypatch.setattr(LlamaContext, "prefill", lambda self, *a, **kw: decoded.append(prefill(self, *a, **kw)) or
                        decoded[-1])
    monkeypatch.setattr(answer_agreement, "dense_answer", lambda *a: pytest.fail("dense's answer decoded again"))
    policies = ["dense", "punctuation", "redecode", "fixed16"]
    cached = run_suite(suite, out, policies=policies, n_threads=1, case_cache=cache, log=None)["records"]
    assert decoded and max(decoded) == SFIConfig().n_prefill_queries  # no prompt (> 1000 tokens) decoded again
    monkeypatch.undo()

    fresh = run_suite(suite, None, policies=policies, n_threads=1, case_cache=False, log=None)["records"]
    assert len(fresh) == len(cached) == 16

    def comparable(records):
        return sorted(({k: v for k, v in r.items() if k != "seconds"} for r in records),
                      key=lambda r: (r["task"], r["case_id"], r["policy"]))

    assert comparable(cached) == comparable(fresh)
    assert any(r["score"] < 1 for r in fresh if r["task"] == "agreement")  # SFI differs from dense here
