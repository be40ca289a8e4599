"""Sentence boundaries from token text: hand-written streams, then the real Qwen2.5 and Gemma 3 vocabularies."""
import time

import pytest

from sfi_gguf.core.boundary import ASCII_ENDERS, CJK_ENDERS, CLOSERS, BoundaryDetector, Ending, PieceTable, Start
from sfi_gguf.models import ensure_model

WS = " \t\n\r\x0b\x0c"


def starts(stream, **kwargs):
    """Indices of the pieces of `stream` that open a sentence (vocabulary = the stream's pieces)."""
    vocab = sorted(set(stream), key=lambda p: p if isinstance(p, bytes) else p.encode())
    detector = BoundaryDetector.from_pieces(vocab, **kwargs)
    return detector.scan([vocab.index(p) for p in stream])


@pytest.mark.parametrize("stream,want", [
    (["Hi", ".", " There"], [2]),
    (["Hi", ".\n\n", "There"], [2]),  # ender merged with newlines
    (["Hi", ". ", "There"], [2]),  # ender followed by a space in the same token
    (["Hi", ".", "\n", "\n\n", " ", "There"], [5]),  # whitespace tokens never open a sentence
    (["Hi", ".", "", " There"], [3]),  # empty (control) pieces are ignored
    (["Really", "?", "!", " Yes"], [3]),  # enders after an ender do not open it either
    (["Why", "?!", "\n", "Because"], [3]),
    (["Stop", "!", " Now", "."], [2]),
    (["Total", ".", " 42", " items"], [2]),  # a number can open a sentence
    ([" pi", " is", " 3", ".", "14", " today", "."], []),  # decimal
    ([" see", " config", ".", "py", " now"], []),  # file name
    ([" www", ".", "example", ".", "com", ".", " Next"], [6]),  # URL, then a real end
    ([" v", "1", ".", "2", ".", "3", " is", " out", ".", " Next"], [9]),  # version
    ([" e", ".g", ".", " Python"], []),  # abbreviations (Qwen's and Gemma's splits)
    ([" e", ".", "g", ".", " Python"], []),
    ([" i", ".e", ".", " Rust"], []),
    ([" Mr", ".", " Smith"], []),
    ([" Dr.", " Who"], []),
    ([" apples", ",", " etc", ".", " And"], []),
    ([" J", ".", " K", ".", " Rowling"], []),  # initials
    (["(", "e", ".g", ".)", " More"], []),
    ([" Hmm", ".", " and", " so"], []),  # ". and": a lowercase word goes on with the sentence
    ([" x", " ?", " y", " :", " z"], []),  # ternary operator
    (["Wait", "...", " Then"], [2]),  # ellipsis: ends a sentence before a capital ...
    (["well", "...", " maybe"], []),  # ... but not before a lowercase word
    (["Loading", "...", "done"], []),  # ... nor inside a word
    (["Wait", "…", " Then"], [2]),
    (["你好", "。", "再见", "？", "好", "！", "\n", "下"], [2, 4, 7]),  # CJK: no space needed
    (["好", "。\n", "下"], [2]),
    (["「", "引用", "。", "」", "下一句"], [4]),  # CJK closing bracket belongs to the ending sentence
    (["He", " said", ' "', "Stop", '."', " Then"], [5]),  # closing quote inside the ender's token
    (["He", " said", ' "', "Stop", ".", '"', " Then"], [6]),  # ... or as a token of its own
    (["(", "Yes", ".)", " Next"], [3]),
    (["Done", ".", ' "', "Next"], [2]),  # an opening quote opens the sentence
    (["Hi", ".", '"\n', "Next"], [3]),  # closing quote + newline confirms the end
    (["Hi", ".", ","], []),  # other punctuation right after a "." cancels it
    (["Hi", ".", "!=", " x"], []),
])
def test_sentence_starts_in_hand_written_streams(stream, want):
    assert starts(stream) == want


def test_bytes_and_str_pieces_are_the_same():
    stream = ["Hi", ".", " There", " 3", ".", "14", "。", "下"]
    assert starts([p.encode() for p in stream]) == starts(stream) == [2, 7]


def test_incomplete_utf8_pieces_are_harmless():
    # byte-level BPE may split a character over two tokens: "。" = e3 80 82 split, "好" split
    stream = [b"\xe5\xa5", b"\xbd", b"\xe3\x80", b"\x82", b"Next", b"\xff"]
    assert starts(stream) == []


def test_custom_abbreviations():
    stream = [" Mr", ".", " Smith", " approx", ".", " Five"]
    assert starts(stream) == []
    assert starts(stream, abbreviations=["approx"]) == [2]


def test_cancel_reset_pending_and_scan_continue_the_state():
    vocab = ["Hi", ".", " There", " Mr"]
    detector = BoundaryDetector.from_pieces(vocab)
    detector.feed(0)
    detector.feed(1)
    assert detector.pending
    detector.cancel()
    assert not detector.pending and not detector.feed(2)
    assert detector.scan([1]) == [] and detector.scan([2]) == [0]  # scan keeps the state between calls
    detector.scan([3])  # " Mr" ...
    detector.reset()  # ... forgotten: the "." no longer closes "Mr."
    assert detector.scan([1, 2]) == [1]


def test_piece_classification():
    pieces = ["", "\n\n", " ", ".", ".\n\n", " .", "...", "?!", "。", "！\n", ".\"", "\")", " the", "The", "3",
              "e.g.", "config.py", " «", "é", "\xa0x"]
    table = PieceTable(pieces)
    ending = {p: Ending(table.ending[i]) for i, p in enumerate(pieces)}
    assert ending == {"": Ending.NONE, "\n\n": Ending.NONE, " ": Ending.NONE, ".": Ending.PERIOD,
                      ".\n\n": Ending.PERIOD, " .": Ending.PERIOD, "...": Ending.ASCII, "?!": Ending.ASCII,
                      "。": Ending.CJK, "！\n": Ending.CJK, ".\"": Ending.PERIOD, "\")": Ending.NONE,
                      " the": Ending.NONE, "The": Ending.NONE, "3": Ending.NONE, "e.g.": Ending.PERIOD,
                      "config.py": Ending.NONE, " «": Ending.NONE, "é": Ending.NONE, "\xa0x": Ending.NONE}
    assert table.period_body(pieces.index("e.g.")) == "e.g"
    start = {p: Start(table.start[i]) for i, p in enumerate(pieces)}
    assert [start[p] for p in ("", "\n\n", "3", "The", "é", ".", "\")", " «")] == \
        [Start.EMPTY, Start.SPACE, Start.DIGIT, Start.LETTER, Start.LETTER, Start.ENDER, Start.CLOSER, Start.SPACE]
    assert start["\xa0x"] == Start.OTHER  # only ASCII whitespace counts as whitespace
    assert [table.is_blank(pieces.index(p)) for p in ("", "\n\n", " ", " the")] == [False, True, True, False]
    punctuation_only = [table.is_punctuation_only(pieces.index(p)) for p in (".", " .", ".\n\n", "\")", " «", "e.g.")]
    assert punctuation_only == [True, True, True, True, False, False]
    lowercase = [table.starts_lowercase(pieces.index(p)) for p in (" the", "The", "é", "3")]
    assert lowercase == [True, False, True, False]
    assert table.piece(pieces.index("。")) == "。".encode() and len(table) == len(pieces)


# -- real vocabularies -----------------------------------------------------------------------------------
MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"]

TEXT = ("The sky is blue. It costs 3.14 dollars, e.g. in Mr. Smith's shop. See config.py or www.example.com "
        "for details! Really? Yes... and no. Dr. Who arrived at 5 p.m. yesterday.\n\nA new paragraph starts "
        "here. 你好。再见！「引用。」下一句。Back to English, i.e. ASCII. \"Quoted.\" Then more, etc. and the end.")
OPENERS = ["It costs", "See config", "Really?", "Yes...", "Dr. Who", "A new", "你好", "再见", "「引用", "下一句",
           "Back to", "\"Quoted", "Then more"]


def slow_classification(piece: bytes):
    """What PieceTable computes with numpy, one piece at a time in plain Python."""
    text = piece.decode("utf-8", errors="replace")
    rest = piece.lstrip(WS.encode())
    first = ""
    for size in range(1, 5):  # the first complete character after the whitespace, if any
        try:
            first = rest[:size].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    tail = text.rstrip(WS).rstrip(CLOSERS)
    run = tail[len(tail.rstrip(ASCII_ENDERS + CJK_ENDERS)):]
    if not run:
        ending = Ending.NONE
    elif any(c in CJK_ENDERS for c in run):
        ending = Ending.CJK
    else:
        ending = Ending.PERIOD if run == "." else Ending.ASCII
    blank = bool(piece) and not rest
    return blank, bool(first) and first.islower(), ending


@pytest.fixture(scope="module", params=MODELS)
def vocabulary(request):
    from sfi_gguf import SFILlama

    llm = SFILlama(ensure_model(request.param), n_ctx=256)
    pieces = [llm.context.token_bytes(t) for t in range(llm.context.n_vocab)]
    yield request.param, llm, pieces
    llm.close()


@pytest.mark.real_model
def test_piece_table_is_fast_and_agrees_with_a_per_piece_classification(vocabulary):
    name, _, pieces = vocabulary
    began = time.perf_counter()
    table = PieceTable(pieces)
    took = time.perf_counter() - began
    print(f"{name}: PieceTable of {len(pieces)} pieces in {took:.3f} s")
    assert took < 2.0  # ~0.3 s on 2 shared cores
    for token, piece in enumerate(pieces):
        blank, lower, ending = slow_classification(piece)
        assert (table.is_blank(token), table.starts_lowercase(token), table.ending[token]) == (blank, lower, ending), \
            (token, piece)


@pytest.mark.real_model
def test_sentence_starts_in_real_tokenizations(vocabulary):
    _, llm, pieces = vocabulary
    tokens = llm.context.tokenize(TEXT, add_special=False)
    assert b"".join(pieces[t] for t in tokens) == TEXT.encode()
    detector = BoundaryDetector(PieceTable(pieces))
    offsets, at = [], 0
    for token in tokens:
        if detector.feed(token):
            offsets.append(at + len(pieces[token]) - len(pieces[token].lstrip(WS.encode())))
        at += len(pieces[token])
    want = [TEXT.encode().index(opener.encode()) for opener in OPENERS]
    assert offsets == want, [TEXT.encode()[o:o + 12].decode(errors="replace") for o in offsets]


@pytest.mark.real_model
def test_each_tokenizer_sees_the_tricky_cases(vocabulary):
    name, llm, pieces = vocabulary
    detector = BoundaryDetector(PieceTable(pieces))
    for text, n_starts in [("Pi is 3.14159 today, see v1.2.3 and config.py for more.", 0),
                           ("We met Dr. Smith and Mrs. Jones, e.g. at 5 p.m. every day.", 0),
                           ("First.\nSecond!\n\nThird? Fourth... Fifth.", 4),
                           ("第一句。第二句！第三句？", 2)]:
        detector.reset()
        assert len(detector.scan(llm.context.tokenize(text, add_special=False))) == n_starts, (name, text)


@pytest.mark.real_model
@pytest.mark.slow
def test_pieces_read_from_the_gguf_file_match_llama_cpp(vocabulary):
    """Without the native library, a vocabulary read with the gguf package gives the same pieces."""
    name, _, native = vocabulary
    pieces = gguf_pieces(ensure_model(name))
    assert len(pieces) == len(native)
    differ = [t for t in range(len(pieces)) if pieces[t] != native[t]]
    # llama.cpp renders a few control-looking tokens ("</s>") as control tokens: empty
    assert len(differ) <= 5 and all(native[t] == b"" for t in differ), [(t, pieces[t]) for t in differ]
    same = set(range(len(pieces))) - set(differ)
    from_file, from_library = PieceTable(pieces).flags, PieceTable(native).flags
    assert all(from_file[t] == from_library[t] for t in same)


def gguf_pieces(path):
    """Every token's text as llama.cpp's token_to_piece renders it, read from the GGUF metadata."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(path))

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    model = strings("tokenizer.ggml.model")[0]
    texts = strings("tokenizer.ggml.tokens")
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    normal, unknown, control, unused, byte = 1, 2, 3, 5, 6  # 4 is user-defined: its text as is
    if model == "gpt2":  # byte-level BPE: every byte is drawn as a printable character
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                     *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        to_byte = {**{c: c for c in printable}, **{256 + i: b for i, b in enumerate(others)}}
        return [b"" if kind in (control, unused) else
                text.translate(to_byte).encode("latin-1") if kind == normal else text.encode()
                for text, kind in zip(texts, types)]
    assert model == "llama", model  # SentencePiece: "▁" is a space, <0xNN> a raw byte
    return [b"" if kind in (control, unused) else
            bytes([int(text[3:-1], 16)]) if kind == byte else
            text.replace("\u2581", " ").encode() if kind in (normal, unknown) else text.encode()
            for text, kind in zip(texts, types)]
