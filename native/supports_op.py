"""A ggml backend's `supports_op`, read from its source and asked about graph nodes.

`SupportsOp(sources, "ggml_metal_device_supports_op", ...)` runs the body of that C / C++ / Objective-C function
on a `Node` (a graph node's op, types, shape and strides, as backend_audit.py records them on the CPU) and answers
True, False or UNKNOWN, with the source line of the `return` that decided. It is not a compiler but a small
interpreter of the statements such functions are written in: switch / case / default, if / else, return, break,
for loops, declarations (several per line, lambdas), and C expressions (casts, ternaries, `->`, `::`, calls).
What it cannot run it does not guess: a statement it cannot parse, a device property not given, or a function
defined in none of the sources is UNKNOWN, with that reason, and so is every verdict that depended on it
(three-valued logic: `false && UNKNOWN` is false, `true && UNKNOWN` is UNKNOWN). Helper functions defined in the
sources (static helpers, other files of the backend) are run the same way; ggml's own tensor predicates
(ggml_is_contiguous, ggml_nbytes ...) are implemented here as ggml.c defines them. Enum and #define constants come
from the headers given (ggml.h).

Standard library only: the audit runs wherever the tests run.
"""
from __future__ import annotations

import re
from collections import ChainMap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# -- values ----------------------------------------------------------------------------------------


class Unknown:
    """A value the interpreter could not know; `reasons` says why (what it depended on)."""

    __slots__ = ("reasons",)

    def __init__(self, *reasons: str):
        self.reasons = frozenset(reasons)

    def __or__(self, other: "Unknown") -> "Unknown":
        u = Unknown()
        u.reasons = self.reasons | other.reasons
        return u

    def __bool__(self):
        raise TypeError("an Unknown has no truth value")

    def __repr__(self):
        return f"UNKNOWN({', '.join(sorted(self.reasons))})"


def unknown_of(*values) -> Unknown:
    u = Unknown()
    for v in values:
        if isinstance(v, Unknown):
            u = u | v
    return u


def is_unknown(v) -> bool:
    return isinstance(v, Unknown)


class Sym(str):
    """An enumerator or other named constant whose value is not known as a number (GGML_TYPE_F16 when no header
    gave its value): equal to the same name only."""


@dataclass
class TypeInfo:
    """Of a ggml type: bytes per block, values per block, quantized."""
    size: int
    blck: int
    quantized: bool


# ggml's types as ggml.c defines them (type_size, blck_size), for the types graphs of decoding hold; others from
# the library (backend_audit passes them in) or UNKNOWN
TYPES = {
    "F32": TypeInfo(4, 1, False), "F16": TypeInfo(2, 1, False), "BF16": TypeInfo(2, 1, False),
    "I8": TypeInfo(1, 1, False), "I16": TypeInfo(2, 1, False), "I32": TypeInfo(4, 1, False),
    "I64": TypeInfo(8, 1, False), "F64": TypeInfo(8, 1, False),
    "Q4_0": TypeInfo(18, 32, True), "Q4_1": TypeInfo(20, 32, True), "Q5_0": TypeInfo(22, 32, True),
    "Q5_1": TypeInfo(24, 32, True), "Q8_0": TypeInfo(34, 32, True), "Q4_K": TypeInfo(144, 256, True),
    "Q5_K": TypeInfo(176, 256, True), "Q6_K": TypeInfo(210, 256, True), "IQ4_NL": TypeInfo(18, 32, True),
}


@dataclass
class Node:
    """A graph node (or a source of one) as supports_op sees it. Types by ggml's name upper-cased ("F16", "Q8_0"),
    op by ggml_op_name ("MUL_MAT"), sub_op the unary or GLU op's name for UNARY / GLU nodes."""
    op: str
    type: str
    ne: Sequence[int] = (1, 1, 1, 1)
    nb: Sequence[int] | None = None  # None: contiguous (outer strides not given: contiguous too)
    src: Sequence["Node | None"] = ()
    op_params: Sequence[int] = ()
    sub_op: str = ""
    name: str = ""
    view_offs: int = 0

    def __post_init__(self):
        self.ne = tuple(int(x) for x in self.ne) + (1,) * (4 - len(self.ne))
        if self.nb is None:
            t = type_info(self.type)
            nb0 = t.size
            nb1 = nb0 * (self.ne[0] // t.blck)
            self.nb = (nb0, nb1, nb1 * self.ne[1], nb1 * self.ne[1] * self.ne[2])
        nb = [int(x) for x in self.nb]
        while len(nb) < 4:  # outer dimensions not given: contiguous over the inner ones
            nb.append(nb[-1] * self.ne[len(nb) - 1])
        self.nb = tuple(nb)
        self.src = tuple(self.src) + (None,) * (10 - len(self.src))
        self.op_params = tuple(int(x) for x in self.op_params) + (0,) * (16 - len(self.op_params))

    def signature(self) -> str:
        """op (sub-op) dst type <- source types: what an audit's table lists."""
        op = f"{self.op}({self.sub_op})" if self.sub_op else self.op
        srcs = ", ".join(s.type for s in self.src if s is not None)
        return f"{op} {self.type} <- {srcs}" if srcs else f"{op} {self.type}"


def type_info(name: str) -> TypeInfo:
    try:
        return TYPES[name]
    except KeyError:
        raise KeyError(f"ggml type {name} is not in supports_op.TYPES (add it from ggml.c's type_traits)") from None


# -- ggml's tensor predicates, as ggml.c defines them ----------------------------------------------


def _contiguous_n(t: Node, n: int) -> bool:
    ti = type_info(t.type)
    next_nb = ti.size
    if t.ne[0] != ti.blck and t.nb[0] != next_nb:
        return False
    next_nb *= t.ne[0] // ti.blck
    for i in range(1, 4):
        if t.ne[i] != 1:
            if i > n:
                if t.nb[i] != next_nb:
                    return False
                next_nb *= t.ne[i]
            else:
                next_nb = t.ne[i] * t.nb[i]
    return True


def _nbytes(t: Node) -> int:
    ti = type_info(t.type)
    if ti.blck == 1:
        n = ti.size
        for i in range(4):
            n += (t.ne[i] - 1) * t.nb[i]
        return n
    n = t.ne[0] * t.nb[0] // ti.blck
    for i in range(1, 4):
        n += (t.ne[i] - 1) * t.nb[i]
    return n


def _type_name(v) -> str | None:
    return v[len("GGML_TYPE_"):] if isinstance(v, str) and v.startswith("GGML_TYPE_") else None


def _tensor_fn(fn):
    def call(*args):
        if any(is_unknown(a) for a in args):
            return unknown_of(*args)
        if any(a is None for a in args):
            return Unknown("a NULL tensor")
        return fn(*args)
    return call


def _type_fn(fn):
    def call(t):
        name = _type_name(t)
        if name is None or name not in TYPES:
            return unknown_of(t) if is_unknown(t) else Unknown(f"type {t}")
        return fn(TYPES[name])
    return call


GGML_FUNCTIONS: dict[str, Callable] = {
    "ggml_is_contiguous": _tensor_fn(lambda t: _contiguous_n(t, 0)),
    "ggml_is_contiguous_0": _tensor_fn(lambda t: _contiguous_n(t, 0)),
    "ggml_is_contiguous_1": _tensor_fn(lambda t: _contiguous_n(t, 1)),
    "ggml_is_contiguous_2": _tensor_fn(lambda t: _contiguous_n(t, 2)),
    "ggml_is_contiguous_rows": _tensor_fn(lambda t: t.ne[0] == type_info(t.type).blck or t.nb[0] == type_info(t.type).size),
    "ggml_is_transposed": _tensor_fn(lambda t: t.nb[0] > t.nb[1]),
    "ggml_is_permuted": _tensor_fn(lambda t: t.nb[0] > t.nb[1] or t.nb[1] > t.nb[2] or t.nb[2] > t.nb[3]),
    "ggml_is_scalar": _tensor_fn(lambda t: t.ne == (1, 1, 1, 1)),
    "ggml_is_vector": _tensor_fn(lambda t: t.ne[1:] == (1, 1, 1)),
    "ggml_is_matrix": _tensor_fn(lambda t: t.ne[2] == 1 and t.ne[3] == 1),
    "ggml_are_same_shape": _tensor_fn(lambda a, b: a.ne == b.ne),
    "ggml_are_same_stride": _tensor_fn(lambda a, b: a.nb == b.nb),
    "ggml_nbytes": _tensor_fn(_nbytes),
    "ggml_nelements": _tensor_fn(lambda t: t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]),
    "ggml_nrows": _tensor_fn(lambda t: t.ne[1] * t.ne[2] * t.ne[3]),
    "ggml_get_unary_op": _tensor_fn(lambda t: Sym("GGML_UNARY_OP_" + t.sub_op) if t.op == "UNARY" else Unknown("not UNARY")),
    "ggml_get_glu_op": _tensor_fn(lambda t: Sym("GGML_GLU_OP_" + t.sub_op) if t.op == "GLU" else Unknown("not GLU")),
    "ggml_get_op_params_i32": lambda t, i: unknown_of(t, i) if is_unknown(t) or is_unknown(i) else t.op_params[i],
    "ggml_type_size": _type_fn(lambda ti: ti.size),
    "ggml_blck_size": _type_fn(lambda ti: ti.blck),
    "ggml_is_quantized": _type_fn(lambda ti: ti.quantized),
}


# -- tokens ----------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\f\v]+|\\\n) | (?P<nl>\n) | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<str>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<num>0[xX][0-9a-fA-F']+[uUlL]*|(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?[fFlL]?|\d[\d']*(?:[eE][+-]?\d+)?[uUlLfF]*)
  | (?P<id>[A-Za-z_]\w*)
  | (?P<op>->|::|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|--|\+=|-=|\*=|/=|%=|&=|\|=|\^=|[-+*/%<>=!~&|^?:;,.()\[\]{}@\#])
""", re.S | re.X)


@dataclass
class Tok:
    kind: str  # id, num, str, op
    text: str
    line: int


def tokenize(text: str, first_line: int = 1) -> list[Tok]:
    """C tokens with their lines; comments and preprocessor lines dropped."""
    out: list[Tok] = []
    line, pos, at_line_start = first_line, 0, True
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise SyntaxError(f"line {line}: cannot tokenize {text[pos:pos + 20]!r}")
        kind, s = m.lastgroup, m.group()
        if kind == "op" and s == "#" and at_line_start:  # a preprocessor line (with its continuations)
            end = pos
            while True:
                end = text.find("\n", end)
                if end < 0 or text[end - 1] != "\\":
                    break
                end += 1
            end = len(text) if end < 0 else end
            line += text.count("\n", pos, end)
            pos = end
            continue
        if kind == "nl":
            at_line_start = True
        elif kind not in ("ws", "comment"):
            at_line_start = False
            out.append(Tok(kind, s, line))
        line += s.count("\n")
        pos = m.end()
    return out


# -- parse -----------------------------------------------------------------------------------------


class ParseError(Exception):
    pass


@dataclass
class E:
    """An expression node: kind and parts."""
    kind: str
    parts: tuple
    line: int


@dataclass
class S:
    """A statement node: kind and parts."""
    kind: str
    parts: tuple
    line: int


TYPE_WORDS = {
    "bool", "char", "short", "int", "long", "float", "double", "void", "unsigned", "signed", "size_t", "auto",
    "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "ggml_type",
    "VkDeviceSize", "ggml_fp16_t",
}
QUALIFIERS = {"const", "static", "constexpr", "struct", "enum", "volatile", "inline", "unsigned", "signed"}
INT_TYPES = {"int", "long", "short", "char", "unsigned", "signed", "size_t", "int8_t", "int16_t", "int32_t",
             "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "VkDeviceSize"}
BINARY = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"),
          ("+", "-"), ("*", "/", "%")]
ASSIGN = {"=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="}


def _is_type_word(text: str) -> bool:
    return text in TYPE_WORDS or text.endswith("_t")


class Parser:
    def __init__(self, toks: list[Tok]):
        self.t = toks
        self.i = 0

    # helpers
    def peek(self, k=0) -> Tok | None:
        j = self.i + k
        return self.t[j] if j < len(self.t) else None

    def at(self, *texts, k=0) -> bool:
        p = self.peek(k)
        return p is not None and p.text in texts and p.kind in ("op", "id")

    def take(self, text=None) -> Tok:
        p = self.peek()
        if p is None or (text is not None and p.text != text):
            raise ParseError(f"line {p.line if p else '?'}: expected {text!r}, got {p.text if p else 'end'!r}")
        self.i += 1
        return p

    def matching(self, j: int) -> int:
        """Index of the bracket closing the one at j."""
        pairs = {"(": ")", "[": "]", "{": "}"}
        depth, open_ = 0, self.t[j].text
        for k in range(j, len(self.t)):
            s = self.t[k].text if self.t[k].kind == "op" else ""
            if s == open_:
                depth += 1
            elif s == pairs[open_]:
                depth -= 1
                if depth == 0:
                    return k
        raise ParseError(f"line {self.t[j].line}: unbalanced {open_}")

    # statements
    def block_body(self) -> list[S]:
        """Statements up to the closing brace (consumed)."""
        out = []
        while not self.at("}"):
            if self.peek() is None:
                raise ParseError("unexpected end in a block")
            out.append(self.statement())
        self.take("}")
        return out

    def statement(self) -> S:
        start = self.i
        try:
            return self._statement()
        except (ParseError, IndexError) as exc:
            self.i = start
            return self._skip_statement(str(exc))

    def _skip_statement(self, why: str) -> S:
        """An opaque statement: skipped to its end, UNKNOWN if run."""
        first = self.peek()
        if first.text in ("for", "while", "if", "switch") and self.at("(", k=1):
            self.i = self.matching(self.i + 1) + 1
            body = self.statement()
            if first.text == "if" and self.at("else"):
                self.take("else")
                self.statement()
            del body
        elif first.text == "{":
            self.i = self.matching(self.i) + 1
        else:
            while not self.at(";"):
                if self.at("(", "[", "{"):
                    self.i = self.matching(self.i)
                elif self.at("}"):
                    break
                self.i += 1
            if self.at(";"):
                self.take(";")
        return S("opaque", (why,), first.line)

    def _statement(self) -> S:
        tok = self.peek()
        line = tok.line
        if self.at("{"):
            self.take("{")
            return S("block", (self.block_body(),), line)
        if self.at(";"):
            self.take(";")
            return S("block", ([],), line)
        if tok.kind == "id":
            if tok.text == "switch":
                self.take()
                self.take("(")
                cond = self.expression()
                self.take(")")
                return S("switch", (cond, self.statement()), line)
            if tok.text == "case":
                self.take()
                value = self.conditional()
                self.take(":")
                return S("label", (value,), line)
            if tok.text == "default" and self.at(":", k=1):
                self.take()
                self.take(":")
                return S("label", (None,), line)
            if tok.text == "if":
                self.take()
                self.take("(")
                cond = self.expression()
                self.take(")")
                then = self.statement()
                other = None
                if self.at("else"):
                    self.take("else")
                    other = self.statement()
                return S("if", (cond, then, other), line)
            if tok.text == "return":
                self.take()
                value = None if self.at(";") else self.expression()
                self.take(";")
                return S("return", (value,), line)
            if tok.text in ("break", "continue"):
                self.take()
                self.take(";")
                return S(tok.text, (), line)
            if tok.text == "for":
                return self._for(line)
        decl = self._declaration()
        if decl is not None:
            self.take(";")
            return decl
        expr = self.expression()
        self.take(";")
        return S("expr", (expr,), line)

    def _for(self, line) -> S:
        self.take("for")
        open_ = self.i
        close = self.matching(open_)
        if any(t.text == ":" and t.kind == "op" for t in self.t[open_:close]) and \
                not any(t.text == "?" for t in self.t[open_:close]):
            raise ParseError(f"line {line}: range-based for")
        self.take("(")
        init = None
        if not self.at(";"):
            init = self._declaration() or S("expr", (self.expression(),), line)
        self.take(";")
        cond = None if self.at(";") else self.expression()
        self.take(";")
        step = None if self.at(")") else self.expression()
        self.take(")")
        return S("for", (init, cond, step, self.statement()), line)

    def _declaration(self) -> S | None:
        """`[qualifiers] type [*&] name [= init] [, [*&] name [= init]]...` (no trailing ';'), or None."""
        j, words = self.i, []
        while j < len(self.t):
            tk = self.t[j]
            if tk.kind == "id":
                words.append(tk.text)
            elif tk.text in ("*", "&", "::"):
                pass
            elif tk.text == "<" and words and words[-1] in ("vector", "array", "pair"):
                depth = 0
                while j < len(self.t):
                    depth += {"<": 1, ">": -1}.get(self.t[j].text, 0)
                    if depth == 0:
                        break
                    j += 1
            else:
                break
            j += 1
        if j >= len(self.t) or len(words) < 2 or self.t[j].text not in ("=", ";", ",", "["):
            return None
        if words[0] in ("return", "case", "else", "delete", "throw", "goto"):
            return None
        # the last word is the first declarator's name
        name_index = max(k for k in range(self.i, j) if self.t[k].kind == "id")
        type_words = [t.text for t in self.t[self.i:name_index] if t.kind == "id"]
        is_int = any(w in INT_TYPES for w in type_words)
        line = self.t[self.i].line
        self.i = name_index
        decls = []
        while True:
            while self.at("*", "&"):
                self.take()
            name = self.take().text
            if self.at("["):  # an array: unknown contents
                self.i = self.matching(self.i) + 1
                decls.append((name, None))
            elif self.at("="):
                self.take("=")
                decls.append((name, self.assignment()))
            else:
                decls.append((name, None))
            if not self.at(","):
                break
            self.take(",")
        return S("decl", (decls, is_int), line)

    # expressions
    def expression(self) -> E:
        e = self.assignment()
        while self.at(","):
            line = self.take(",").line
            e = E("comma", (e, self.assignment()), line)
        return e

    def assignment(self) -> E:
        left = self.conditional()
        tok = self.peek()
        if tok is not None and tok.kind == "op" and tok.text in ASSIGN:
            self.take()
            return E("assign", (tok.text, left, self.assignment()), tok.line)
        return left

    def conditional(self) -> E:
        cond = self.binary(0)
        if self.at("?"):
            line = self.take("?").line
            a = self.assignment()
            self.take(":")
            b = self.conditional()
            return E("cond", (cond, a, b), line)
        return cond

    def binary(self, level: int) -> E:
        if level == len(BINARY):
            return self.unary()
        left = self.binary(level + 1)
        while True:
            tok = self.peek()
            if tok is None or tok.kind != "op" or tok.text not in BINARY[level]:
                return left
            self.take()
            left = E("bin", (tok.text, left, self.binary(level + 1)), tok.line)

    def _cast_ahead(self) -> int | None:
        """At '(': the index after ')' when it opens a C cast `(type words [*&])`."""
        close = self.matching(self.i)
        inner = self.t[self.i + 1:close]
        ids = [t.text for t in inner if t.kind == "id"]
        if not ids or any(t.kind not in ("id",) and t.text not in ("*", "&", "::") for t in inner):
            return None
        if not (any(_is_type_word(w) for w in ids) or ids[0] in ("struct", "const", "enum") or
                (len(inner) > 1 and inner[-1].text in ("*", "&"))):
            return None
        after = self.t[close + 1] if close + 1 < len(self.t) else None
        if after is None or not (after.kind in ("id", "num") or after.text in ("(", "!", "~", "-", "+", "*", "&")):
            return None
        return close + 1

    def unary(self) -> E:
        tok = self.peek()
        if tok.kind == "op" and tok.text in ("!", "-", "+", "~", "*", "&", "++", "--"):
            self.take()
            return E("un", (tok.text, self.unary()), tok.line)
        if tok.kind == "id" and tok.text == "sizeof":
            self.take()
            if self.at("("):
                close = self.matching(self.i)
                words = " ".join(t.text for t in self.t[self.i + 1:close])
                self.i = close + 1
                return E("sizeof", (words,), tok.line)
            return E("sizeof", (self.unary(),), tok.line)
        if tok.kind == "op" and tok.text == "(":
            after = self._cast_ahead()
            if after is not None:
                words = [t.text for t in self.t[self.i + 1:after - 1] if t.kind == "id"]
                self.i = after
                return E("cast", (words, self.unary()), tok.line)
        return self.postfix()

    def postfix(self) -> E:
        e = self.primary()
        while True:
            tok = self.peek()
            if tok is None:
                return e
            if tok.text == "(" and tok.kind == "op":
                self.take()
                args = []
                while not self.at(")"):
                    args.append(self.assignment())
                    if not self.at(")"):
                        self.take(",")
                self.take(")")
                e = E("call", (e, args), tok.line)
            elif tok.text == "[" and tok.kind == "op":
                self.take()
                idx = self.expression()
                self.take("]")
                e = E("index", (e, idx), tok.line)
            elif tok.text in ("->", ".") and tok.kind == "op":
                self.take()
                e = E("member", (e, self.take().text), tok.line)
            elif tok.text in ("++", "--") and tok.kind == "op":
                self.take()
                e = E("post", (tok.text, e), tok.line)
            elif tok.text == "{" and e.kind == "name" and _is_type_word(e.parts[0]):  # VkDeviceSize{x}
                self.take()
                args = []
                while not self.at("}"):
                    args.append(self.assignment())
                    if not self.at("}"):
                        self.take(",")
                self.take("}")
                e = E("call", (e, args), tok.line)
            else:
                return e

    def primary(self) -> E:
        tok = self.take()
        if tok.kind == "num":
            text = tok.text.replace("'", "")  # C++14 digit separators
            s = text.rstrip("uUlLfF") if not text.lower().startswith("0x") else text.rstrip("uUlL")
            value = float(s) if ("." in s or ("e" in s.lower() and not s.lower().startswith("0x"))) else int(s, 0)
            return E("const", (value,), tok.line)
        if tok.kind == "str":
            return E("const", (tok.text,), tok.line)
        if tok.kind == "op" and tok.text == "(":
            e = self.expression()
            self.take(")")
            return e
        if tok.kind == "op" and tok.text == "[":  # a lambda
            self.i = self.matching(self.i - 1) + 1
            params = self._params()
            if self.at("->"):
                while not self.at("{"):
                    self.take()
            self.take("{")
            return E("lambda", (params, self.block_body()), tok.line)
        if tok.kind == "op" and tok.text == "::":
            return self.primary()
        if tok.kind == "id":
            name = tok.text
            while self.at("::") and self.peek(1) is not None and self.peek(1).kind == "id":
                self.take("::")
                name += "::" + self.take().text
            if name in ("true", "false"):
                return E("const", (name == "true",), tok.line)
            if name in ("NULL", "nullptr"):
                return E("const", (None,), tok.line)
            if self.at("<") and name.split("::")[-1] in ("min", "max", "static_cast", "reinterpret_cast",
                                                         "const_cast", "numeric_limits"):
                depth = 0
                while True:
                    t = self.take()
                    depth += {"<": 1, ">": -1}.get(t.text, 0)
                    if depth == 0:
                        break
            return E("name", (name,), tok.line)
        raise ParseError(f"line {tok.line}: unexpected {tok.text!r}")

    def _params(self) -> list[str]:
        """`(type name, ...)`: the names."""
        self.take("(")
        names, last = [], None
        depth = 0
        while True:
            t = self.take()
            if t.text == "(":
                depth += 1
            elif t.text == ")" and depth:
                depth -= 1
            elif t.text in (",", ")") and depth == 0:
                if last is not None:
                    names.append(last)
                last = None
                if t.text == ")":
                    return names
            elif t.kind == "id" and t.text != "void":
                last = t.text


# -- functions in the sources ----------------------------------------------------------------------


@dataclass
class Function:
    name: str
    params: list[str]
    body: list[S]
    file: str


def find_function(toks: list[Tok], name: str) -> tuple[list[str], list[Tok]] | None:
    """(parameter names, body tokens) of the definition of `name` among a file's tokens, or None."""
    p = Parser(toks)
    for i, tk in enumerate(toks):
        if tk.kind != "id" or tk.text != name or i == 0 or i + 1 >= len(toks) or toks[i + 1].text != "(":
            continue
        before = toks[i - 1]
        if not (before.kind == "id" and before.text not in ("return", "else", "case", "new", "delete")
                or before.text in ("*", "&")):
            continue  # a call, not a definition
        close = p.matching(i + 1)
        j = close + 1
        if j < len(toks) and toks[j].text == "const":
            j += 1
        if j >= len(toks) or toks[j].text != "{":
            continue  # a declaration
        params, depth, last = [], 0, None
        for t in toks[i + 2:close + 1]:
            if t.text in ("(", "[", "<"):
                depth += 1
            elif t.text in (")", "]", ">") and depth:
                depth -= 1
            elif t.text in (",", ")") and depth == 0:
                if last is not None:
                    params.append(last)
                last = None
            elif t.kind == "id" and t.text != "void":
                last = t.text
        return params, toks[j + 1:p.matching(j)]
    return None


def header_constants(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """(enumerators, integer constants) of a header or source: the values of every `enum ... { ... }`, and of
    `#define NAME expr` and `constexpr T NAME = expr` (expressions of earlier values included)."""
    enums: dict[str, int] = {}
    defines: dict[str, int] = {}
    interp = Interpreter({}, {}, enums, defines)

    def const(expr: str):
        value = _const_value(interp, expr)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+([^\n]+)$", text, re.M):
        value = const(m.group(2).split("//")[0])
        if value is not None:
            defines[m.group(1)] = value
    for m in re.finditer(r"\bconstexpr\s+[\w:]+\s+(\w+)\s*=\s*([^;]+);", text):
        value = const(m.group(2))
        if value is not None:
            defines[m.group(1)] = value
    for m in re.finditer(r"\benum\s+\w*\s*(?::\s*\w+\s*)?\{(.*?)\}", text, re.S):
        body = re.sub(r"//[^\n]*|/\*.*?\*/", "", m.group(1), flags=re.S)
        nxt: int | None = 0
        for entry in body.split(","):
            name, _, expr = entry.strip().partition("=")
            name = name.strip()
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                continue
            if expr.strip():
                nxt = const(expr)
            if nxt is not None:
                enums.setdefault(name, nxt)
                nxt += 1
    return enums, defines


def _const_value(interp: "Interpreter", text: str):
    try:
        toks = tokenize(text)
        if not toks:
            return None
        p = Parser(toks)
        e = p.expression()
        if p.peek() is not None:
            return None
        return interp.eval(e, ChainMap())
    except (ParseError, SyntaxError, Exception):  # noqa: BLE001  (anything not a constant expression)
        return None


# -- run -------------------------------------------------------------------------------------------


class Props:
    """Device properties given by name (nested dicts for `a.b.c`); a property not given is UNKNOWN."""

    def __init__(self, values: dict, path: str):
        self.values, self.path = values, path

    def member(self, name: str):
        path = f"{self.path}.{name}" if "->" in self.path else f"{self.path}->{name}"
        if name not in self.values:
            return Unknown(path)
        v = self.values[name]
        return Props(v, path) if isinstance(v, dict) else v


@dataclass
class Return:
    value: Any
    line: int


class _Break:
    pass


class _Continue:
    pass


BREAK, CONTINUE = _Break(), _Continue()


@dataclass
class Closure:
    params: list[str]
    body: list[S]
    env: Any


class Interpreter:
    """Runs parsed statements; `functions` are the sources' definitions (found by `finder` on first call),
    `builtins` Python functions, `enums` the enumerators (their names are compared, their values used in
    arithmetic), `defines` integer constants. Variables live in a ChainMap (a lambda's call adds a map)."""

    MAX_LOOP = 256

    def __init__(self, functions: dict[str, Function], builtins: dict[str, Callable], enums: dict[str, int],
                 defines: dict[str, int], finder: Callable[[str], Function | None] | None = None):
        self.functions, self.builtins, self.enums, self.defines = functions, builtins, enums, defines
        self.finder = finder
        self.depth = 0

    # statements
    def run_function(self, fn: Function, args: list) -> Return:
        env = ChainMap(dict(zip(fn.params, args)))
        self.depth += 1
        try:
            if self.depth > 32:
                return Return(Unknown(f"recursion in {fn.name}"), 0)
            sig = self.exec_list(fn.body, env)
        finally:
            self.depth -= 1
        if isinstance(sig, Return):
            return sig
        return Return(Unknown(f"{fn.name} ends without a return"), 0)

    def exec_list(self, stmts: list[S], env):
        for s in stmts:
            sig = self.exec(s, env)
            if sig is not None:
                return sig
        return None

    def exec(self, s: S, env):
        k = s.kind
        if k == "block":
            return self.exec_list(s.parts[0], env)
        if k == "expr":
            self.eval(s.parts[0], env)
            return None
        if k == "decl":
            decls, is_int = s.parts
            for name, init in decls:
                if init is None:
                    env[name] = Unknown(f"{name} uninitialised")
                else:
                    v = self.eval(init, env)
                    if is_int and isinstance(v, float):
                        v = int(v)
                    env[name] = v
            return None
        if k == "return":
            value = True if s.parts[0] is None else self.eval(s.parts[0], env)
            return Return(value, s.line)
        if k == "break":
            return BREAK
        if k == "continue":
            return CONTINUE
        if k == "label":
            return None
        if k == "if":
            cond, then, other = s.parts
            c = self.truth(self.eval(cond, env))
            if is_unknown(c):
                return self._both(c, then, other, env, s.line)
            if c:
                return self.exec(then, env)
            return self.exec(other, env) if other is not None else None
        if k == "switch":
            return self._switch(s, env)
        if k == "for":
            return self._for(s, env)
        if k == "opaque":
            return Return(Unknown(f"line {s.line}: statement not understood ({s.parts[0]})"), s.line)
        raise AssertionError(k)

    def _both(self, c: Unknown, then: S, other: S | None, env: ChainMap, line: int):
        """An if whose condition is UNKNOWN: both branches, each on a copy of the variables; the same outcome is
        the outcome (variables that then differ become UNKNOWN)."""
        outs, envs = [], []
        for branch in (then, other):
            e = ChainMap(*[dict(m) for m in env.maps])
            outs.append(self.exec(branch, e) if branch is not None else None)
            envs.append(e)
        a, b = outs
        if a is None and b is None:
            for m, ma, mb in zip(env.maps, envs[0].maps, envs[1].maps):
                for name in set(ma) | set(mb):
                    va, vb = ma.get(name), mb.get(name)
                    m[name] = va if _same(va, vb) or va is vb else unknown_of(c)
            return None
        if isinstance(a, Return) and isinstance(b, Return) and _same(a.value, b.value):
            return a
        reasons = c
        for o in outs:
            if isinstance(o, Return) and is_unknown(o.value):
                reasons = reasons | o.value
        return Return(reasons, line)

    def _switch(self, s: S, env):
        cond, body = s.parts
        value = self.eval(cond, env)
        stmts = body.parts[0] if body.kind == "block" else [body]
        if is_unknown(value):
            return Return(value, s.line)
        start = None
        for i, st in enumerate(stmts):
            if st.kind == "label" and st.parts[0] is not None:
                eq = self._equal(value, self.eval(st.parts[0], env))
                if is_unknown(eq):
                    return Return(eq, st.line)
                if eq:
                    start = i
                    break
        if start is None:
            start = next((i for i, st in enumerate(stmts) if st.kind == "label" and st.parts[0] is None), None)
        if start is None:
            return None
        for st in stmts[start:]:
            sig = self.exec(st, env)
            if sig is BREAK:
                return None
            if sig is not None:
                return sig
        return None

    def _for(self, s: S, env):
        init, cond, step, body = s.parts
        if init is not None:
            self.exec(init, env)
        for _ in range(self.MAX_LOOP):
            if cond is not None:
                c = self.truth(self.eval(cond, env))
                if is_unknown(c):
                    return Return(c, s.line)
                if not c:
                    return None
            sig = self.exec(body, env)
            if sig is BREAK:
                return None
            if isinstance(sig, Return):
                return sig
            if step is not None:
                self.eval(step, env)
        return Return(Unknown(f"line {s.line}: loop of more than {self.MAX_LOOP} iterations"), s.line)

    # expressions
    def truth(self, v):
        if is_unknown(v):
            return v
        if isinstance(v, (Props, Node, Closure, Function, str)) or callable(v):
            return True
        return bool(v)

    def _equal(self, a, b):
        if is_unknown(a) or is_unknown(b):
            return unknown_of(a, b)
        if isinstance(a, Sym) and isinstance(b, Sym):
            return str(a) == str(b)
        if isinstance(a, Sym) or isinstance(b, Sym):
            a, b = self._numeric(a), self._numeric(b)
            if is_unknown(a) or is_unknown(b):
                return unknown_of(a, b)
        return a == b

    def eval(self, e: E, env):
        k = e.kind
        if k == "const":
            return e.parts[0]
        if k == "name":
            return self.lookup(e.parts[0], env, e.line)
        if k == "member":
            obj = self.eval(e.parts[0], env)
            return self.member(obj, e.parts[1])
        if k == "index":
            obj, idx = self.eval(e.parts[0], env), self.eval(e.parts[1], env)
            if is_unknown(obj) or is_unknown(idx):
                return unknown_of(obj, idx)
            if isinstance(obj, (list, tuple)):
                return obj[idx] if 0 <= idx < len(obj) else Unknown(f"index {idx} out of range")
            return Unknown(f"line {e.line}: indexing")
        if k == "call":
            return self.call(e, env)
        if k == "bin":
            return self.binop(e, env)
        if k == "un":
            return self.unop(e, env)
        if k == "cond":
            c = self.truth(self.eval(e.parts[0], env))
            if is_unknown(c):
                a, b = self.eval(e.parts[1], env), self.eval(e.parts[2], env)
                return a if _same(a, b) else unknown_of(c, a, b)
            return self.eval(e.parts[1] if c else e.parts[2], env)
        if k == "cast":
            words, inner = e.parts
            v = self.eval(inner, env)
            if any(w in INT_TYPES for w in words) and isinstance(v, (int, float)) and not isinstance(v, bool):
                return int(v)
            if words and words[-1] == "float" and isinstance(v, (int, float)):
                return float(v)
            if "bool" in words and not is_unknown(v):
                return self.truth(v)
            return v
        if k == "sizeof":
            what = e.parts[0]
            sizes = {"float": 4, "double": 8, "int": 4, "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8,
                     "size_t": 8, "ggml_fp16_t": 2, "int16_t": 2, "uint16_t": 2, "int8_t": 1, "uint8_t": 1}
            return sizes.get(what, Unknown(f"sizeof({what})")) if isinstance(what, str) else Unknown("sizeof")
        if k == "assign":
            op, target, value = e.parts
            v = self.eval(value, env)
            if op != "=":
                v = self._arith(op[:-1], self.eval(target, env), v)
            if target.kind == "name":
                self._store(env, target.parts[0], v)
            return v
        if k == "post":
            op, target = e.parts
            old = self.eval(target, env)
            if target.kind == "name":
                self._store(env, target.parts[0], self._arith("+" if op == "++" else "-", old, 1))
            return old
        if k == "comma":
            self.eval(e.parts[0], env)
            return self.eval(e.parts[1], env)
        if k == "lambda":
            return Closure(e.parts[0], e.parts[1], env)
        raise AssertionError(k)

    def _store(self, env: ChainMap, name, v):
        for m in env.maps:
            if name in m:
                m[name] = v
                return
        env[name] = v

    def lookup(self, name: str, env, line: int):
        if name in env:
            return env[name]
        short = name.split("::")[-1]
        if name in self.defines:
            return self.defines[name]
        if name in self.enums:
            return Sym(name)
        if short in self.builtins or name in self.builtins:
            return self.builtins.get(name) or self.builtins[short]
        fn = self.function(short)
        if fn is not None:
            return fn
        if re.fullmatch(r"GGML_[A-Z0-9_]+", name):
            return Sym(name)
        return Unknown(name)

    def function(self, name: str) -> Function | None:
        if name not in self.functions and self.finder is not None:
            self.functions[name] = self.finder(name)
        return self.functions.get(name)

    def member(self, obj, name: str):
        if is_unknown(obj):
            return obj
        if obj is None:
            return Unknown(f"->{name} of NULL")
        if isinstance(obj, Props):
            return obj.member(name)
        if isinstance(obj, Node):
            if name == "type":
                return Sym("GGML_TYPE_" + obj.type)
            if name == "op":
                return Sym("GGML_OP_" + obj.op)
            if name in ("ne", "nb", "src", "op_params", "view_offs", "name"):
                return getattr(obj, name)
            return Unknown(f"tensor->{name}")
        return Unknown(f".{name}")

    def call(self, e: E, env):
        callee_e, arg_es = e.parts
        args = [self.eval(a, env) for a in arg_es]
        if callee_e.kind == "name" and _is_type_word(callee_e.parts[0].split("::")[-1]):  # uint32_t(x), float(x)
            v = args[0] if args else Unknown("cast")
            word = callee_e.parts[0]
            if word in INT_TYPES and isinstance(v, (int, float)) and not isinstance(v, bool):
                return int(v)
            if word == "float" and isinstance(v, (int, float)):
                return float(v)
            return v
        if callee_e.kind == "name" and callee_e.parts[0].split("::")[-1] in ("min", "max") and len(args) == 2:
            if any(is_unknown(a) for a in args):
                return unknown_of(*args)
            return (min if callee_e.parts[0].endswith("min") else max)(args)
        if callee_e.kind == "name" and callee_e.parts[0] in ("log2f", "log2") and len(args) == 1:
            import math
            return unknown_of(args[0]) if is_unknown(args[0]) else math.log2(args[0])
        callee = self.eval(callee_e, env)
        if is_unknown(callee):
            return Unknown(f"line {e.line}: call of {callee_e.parts[0] if callee_e.kind == 'name' else '?'}")
        if isinstance(callee, Closure):
            local = callee.env.new_child(dict(zip(callee.params, args)))
            sig = self.exec_list(callee.body, local)
            return sig.value if isinstance(sig, Return) else Unknown("lambda ends without a return")
        if isinstance(callee, Function):
            return self.run_function(callee, args).value
        if callable(callee):
            return callee(*args)
        return Unknown(f"line {e.line}: call")

    def binop(self, e: E, env):
        op, a_e, b_e = e.parts
        if op in ("&&", "||"):
            a = self.truth(self.eval(a_e, env))
            if not is_unknown(a) and (a is False if op == "&&" else a is True):
                return a
            b = self.truth(self.eval(b_e, env))
            if is_unknown(a):
                if not is_unknown(b) and (b is False if op == "&&" else b is True):
                    return b
                return unknown_of(a, b)
            return b
        a, b = self.eval(a_e, env), self.eval(b_e, env)
        if op in ("==", "!="):
            eq = self._equal(a, b)
            return eq if is_unknown(eq) else (eq if op == "==" else not eq)
        return self._arith(op, a, b)

    def _numeric(self, v):
        """An enumerator as its number, where a header gave it."""
        if isinstance(v, Sym):
            return self.enums.get(str(v), Unknown(f"value of {v}"))
        return v

    def _arith(self, op, a, b):
        a, b = self._numeric(a), self._numeric(b)
        if is_unknown(a) or is_unknown(b):
            return unknown_of(a, b)
        if not all(isinstance(x, (int, float)) for x in (a, b)):
            return Unknown(f"{a!r} {op} {b!r}")
        if op == "/":
            if b == 0:
                return Unknown("division by zero")
            return a // b if isinstance(a, int) and isinstance(b, int) and a >= 0 and b > 0 else (
                int(a / b) if isinstance(a, int) and isinstance(b, int) else a / b)
        if op == "%":
            return Unknown("modulo by zero") if b == 0 else (a % b if a >= 0 and b > 0 else Unknown("signed %"))
        return {
            "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "<": lambda: a < b, ">": lambda: a > b,
            "<=": lambda: a <= b, ">=": lambda: a >= b, "<<": lambda: a << b, ">>": lambda: a >> b,
            "&": lambda: a & b, "|": lambda: a | b, "^": lambda: a ^ b,
        }[op]()

    def unop(self, e: E, env):
        op, inner = e.parts
        if op in ("++", "--"):
            v = self._arith("+" if op == "++" else "-", self.eval(inner, env), 1)
            if inner.kind == "name":
                self._store(env, inner.parts[0], v)
            return v
        v = self.eval(inner, env)
        if op == "!":
            t = self.truth(v)
            return t if is_unknown(t) else not t
        if op in ("*", "&", "+"):
            return v
        v = self._numeric(v)
        if is_unknown(v):
            return v
        if op == "-":
            return -v
        if op == "~":
            return ~v
        raise AssertionError(op)


def _same(a, b) -> bool:
    if is_unknown(a) or is_unknown(b):
        return False
    return type(a) is type(b) and a == b


# -- the public face -------------------------------------------------------------------------------


@dataclass
class Verdict:
    supported: bool | None  # None: UNKNOWN
    line: int               # of the deciding return (0 if none)
    reasons: frozenset = field(default_factory=frozenset)

    def __str__(self):
        if self.supported is None:
            return "unknown (" + "; ".join(sorted(self.reasons)) + ")"
        return f"{'yes' if self.supported else 'no'} (line {self.line})"


class Sources:
    """The functions defined in `sources` (file name -> text), run by name: `call(name, param=value ...)`;
    `overrides` replace functions of the sources (by name) with Python ones; `headers` give enumerators and
    constants (ggml.h)."""

    def __init__(self, sources: dict[str, str], overrides: dict[str, Callable] | None = None,
                 headers: Iterable[str] = ()):
        self.tokens = {file: tokenize(text) for file, text in sources.items()}
        enums: dict[str, int] = {}
        defines: dict[str, int] = {}
        for text in list(headers) + list(sources.values()):
            e, d = header_constants(text)
            for name, value in e.items():
                enums.setdefault(name, value)
            for name, value in d.items():
                defines.setdefault(name, value)
        self.interp = Interpreter({}, {**GGML_FUNCTIONS, **(overrides or {})}, enums, defines, finder=self._find)

    def function(self, name: str) -> Function:
        fn = self.interp.function(name)
        if fn is None:
            raise ParseError(f"no definition of {name} in {', '.join(self.tokens)}")
        return fn

    def _find(self, name: str) -> Function | None:
        for file, toks in self.tokens.items():
            found = find_function(toks, name)
            if found is not None:
                params, body = found
                p = Parser(body)
                stmts = []
                while p.peek() is not None:
                    stmts.append(p.statement())
                return Function(name, params, stmts, file)
        return None

    def call(self, name: str, **bind) -> Verdict:
        """Run `name` with its parameters bound by name (any other is UNKNOWN); its result as a Verdict."""
        fn = self.function(name)
        ret = self.interp.run_function(fn, [bind.get(p, Unknown(p)) for p in fn.params])
        v = ret.value
        if is_unknown(v):
            return Verdict(None, ret.line, v.reasons)
        return Verdict(bool(self.interp.truth(v)), ret.line)


def opaque_statements(fn: Function) -> list[S]:
    """The statements of fn (not of the helpers it calls) that were not understood."""
    out: list[S] = []

    def walk(x):
        if isinstance(x, S):
            if x.kind == "opaque":
                out.append(x)
            for part in x.parts:
                walk(part)
        elif isinstance(x, (list, tuple)):
            for part in x:
                walk(part)
    walk(fn.body)
    return out


class SupportsOp:
    """A backend's supports_op function (`function` of `sources`), asked about nodes: the node is bound to its
    parameter `node_param`, `bind` gives others (e.g. a Props for the device)."""

    def __init__(self, sources: Sources, function: str, node_param: str = "op", bind: dict | None = None):
        self.sources, self.name = sources, function
        self.fn = sources.function(function)
        if node_param not in self.fn.params:
            raise ParseError(f"{function} has no parameter {node_param} (has {', '.join(self.fn.params)})")
        self.node_param = node_param
        self.bind = dict(bind or {})

    def __call__(self, node: Node) -> Verdict:
        return self.sources.call(self.name, **{**self.bind, self.node_param: node})


def read(path: Path) -> str:
    return Path(path).read_text(errors="replace")
