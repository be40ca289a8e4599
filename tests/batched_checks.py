"""Checks that test_batched_native runs on a random-weight model and test_rpc.py on layers placed on
rpc-servers: one llama_decode of sequences in any mix of slow, dense and fast steps equals one decode per kind."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from sfi_gguf.core import bindings
from sfi_gguf.core.bindings import SFINative
from native_harness import MultiCtx, select_all, seq_cells, tokens_for


def _at_cells(values: np.ndarray, cells: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """values [n_head_kv, n] of candidate cells `cells` [n], at the cells `wanted` (a subset), in order."""
    return values[:, np.argsort(cells)[np.searchsorted(np.sort(cells), wanted)]]


# per step, each of 4 sequences' mode: runs of one kind of every length and order, all of one kind, each alone
MIXES = ("FSFD", "SFFS", "DDSF", "FFFF", "SSSS", "FDSS", "SFSF", "DFFF")
MODE_OF = {"F": SFINative.FAST, "S": SFINative.SLOW, "D": SFINative.DENSE}


# the mixed-step tests' four sequences and the device Selector's budget
MIXED_PROMPTS = (150, 201, 120, 170)
MIXED_SINK, MIXED_RECENT, MIXED_K_HEAD = 4, 32, 48


@contextmanager
def one_and_by_kind(model, flash_attn, export, offload_kqv=True):
    """Two contexts holding the same four prompts, each with SFI on every sequence (all its cells selected) and the
    export of `export` ("every_cell", "candidates" or "device_selector"): (one, by_kind, sfi_one, sfi_kind), closed
    afterwards. One decodes a step's sequences in one llama_decode, the other one decode per kind."""
    from sfi_gguf.core.selector import SFISelector

    one = MultiCtx(model, n_seq=len(MIXED_PROMPTS), flash_attn=flash_attn, offload_kqv=offload_kqv)
    by_kind = MultiCtx(model, n_seq=len(MIXED_PROMPTS), flash_attn=flash_attn, offload_kqv=offload_kqv)
    try:
        for c in (one, by_kind):
            for s, n in enumerate(MIXED_PROMPTS):
                c.prefill(s, tokens_for(model, n, seed=10 + s))
        sfis = [SFINative(c.ctx, n_sel_max=256, n_tail_max=64) for c in (one, by_kind)]
        for sfi in sfis:
            if export != "every_cell":
                sfi.set_n_candidates(64)
            if export == "device_selector":
                sfi.set_selector(SFISelector().device_params(MIXED_K_HEAD, MIXED_SINK, MIXED_RECENT))
            for s in range(len(MIXED_PROMPTS)):
                select_all(sfi, s)
        yield (one, by_kind, *sfis)
    finally:
        one.close()
        by_kind.close()


def mixed_equals_by_kind(model, flash_attn, export, offload_kqv=True):
    """test_batched_native's test_one_decode_equals_its_sequences_decoded_by_kind on `model` (test_rpc.py runs it with
    the cache in host memory and the views on an rpc-server)."""
    n_seq = len(MIXED_PROMPTS)
    with one_and_by_kind(model, flash_attn, export, offload_kqv) as (one, by_kind, sfi_one, sfi_kind):
        sfis = [sfi_one, sfi_kind]
        toks = {s: 3 + s for s in range(n_seq)}
        for step, mix in enumerate(MIXES):
            for s in range(n_seq):
                sfi_one.set_mode(MODE_OF[mix[s]], seq=s)
            lo = one.step(toks)
            lk = {}
            for kind in "SDF":
                seqs = [s for s in range(n_seq) if mix[s] == kind]
                if seqs:
                    sfi_kind.set_mode(MODE_OF[kind])
                    lk.update(by_kind.step({s: toks[s] for s in seqs}))
            for s in range(n_seq):
                # (batches of other sizes round differently: a few thousandths on a GPU after some steps)
                assert np.abs(lo[s] - lk[s]).max() < 2e-2 and lo[s].argmax() == lk[s].argmax(), (step, s)
                assert bool(sfi_one.status(s) & bindings.STATUS_LAST_FAST) == (mix[s] == "F"), (step, s)
                assert (sfi_one.mass(s) is not None) == (mix[s] == "S" and export != "device_selector"), (step, s)
            for s in range(n_seq):
                if mix[s] == "D":
                    for sfi in sfis:
                        select_all(sfi, s)
                if mix[s] != "S":
                    continue
                if export == "device_selector":
                    # the same cells in each row up to near-ties, which may go the other way in another batch (a
                    # few cells of a row on a GPU; another sequence's selection would share about a quarter)
                    x, ref = sfi_one.selection(s), sfi_kind.selection(s)
                    assert x.shape == ref.shape, (step, s)
                    rows_x, rows_ref = x.reshape(-1, x.shape[-1]), ref.reshape(-1, ref.shape[-1])
                    shared = [len(np.intersect1d(a, b)) / len(a) for a, b in zip(rows_x, rows_ref)]
                    assert min(shared) > 0.9, (step, s, shared)
                    # (selections that differ by a near-tie would part the next fast steps' logits: then
                    # both take all their cells again)
                    same = np.array_equal(x, ref)
                    for sfi in sfis:
                        if same:
                            sfi.load_selection(s)
                        else:
                            select_all(sfi, s)
                    continue
                for get in ("mass", "evidence", "key_norms"):
                    x, ref = getattr(sfi_one, get)(s), getattr(sfi_kind, get)(s)
                    if export == "candidates":
                        # the same cells up to a near-tie at the last candidate, compared cell by cell
                        cx, cr = sfi_one.candidates(s), sfi_kind.candidates(s)
                        common = [np.intersect1d(cx[i], cr[i]) for i in range(len(cx))]
                        assert min(map(len, common)) >= 0.95 * cx.shape[1], (step, s)
                        x, ref = [np.concatenate([_at_cells(v[i], c[i], common[i]) for i in range(len(c))], axis=1)
                                  for v, c in ((x, cx), (ref, cr))]
                    assert x.shape == ref.shape and np.abs(x - ref).max() / np.abs(ref).max() < 5e-3, (step, s, get)
                # both reload the sequence's cells in the order of one export's mass
                mass, cells = sfi_kind.mass(s), seq_cells(sfi_kind, s)
                if export == "candidates":
                    for sfi in sfis:
                        select_all(sfi, s)
                    continue
                order = np.argsort(-mass[:, :, cells], axis=-1, kind="stable")
                for sfi in sfis:
                    select_all(sfi, s, order)
            toks = {s: int(np.argmax(lk[s])) for s in range(n_seq)}


def staggered_refreshes(model, flash_attn):
    """test_batched_native's test_staggered_refreshes on `model` (test_rpc.py runs it with layers on an
    rpc-server)."""
    n_seq = len(MIXED_PROMPTS)
    with one_and_by_kind(model, flash_attn, "device_selector") as (one, by_kind, sfi_one, sfi_kind):
        sfis = [sfi_one, sfi_kind]
        mixes = ["".join("S" if j == i else "F" for j in range(n_seq)) for i in range(n_seq)]
        toks = {s: 3 + s for s in range(n_seq)}
        for cycle in range(3):
            for step, mix in enumerate(mixes):
                slow = mix.index("S")
                for s in range(n_seq):
                    sfi_one.set_mode(MODE_OF[mix[s]], seq=s)
                lo, lk = one.step(toks), {}
                for kind in "SF":
                    sfi_kind.set_mode(MODE_OF[kind])
                    lk.update(by_kind.step({s: toks[s] for s in range(n_seq) if mix[s] == kind}))
                for s in range(n_seq):
                    assert np.abs(lo[s] - lk[s]).max() < 2e-2 and lo[s].argmax() == lk[s].argmax(), (cycle, step, s)
                    toks[s] = int(lk[s].argmax())
                # the slow sequence's new memory: the device selection, unless a near-tie parted the two (then all
                # its cells, for both; its next fast step gathers them, a mix of its own)
                same = np.array_equal(np.sort(sfi_one.selection(slow), axis=-1), np.sort(sfi_kind.selection(slow), axis=-1))
                for sfi in sfis:
                    if same:
                        sfi.load_selection(slow)
                    else:
                        select_all(sfi, slow)
