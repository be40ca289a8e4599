"""The tool-call formats models write, read from their answers as llama.cpp's chat parsers read them.

Each format scans an answer (whole, or the part streamed so far) into its text outside the calls and the calls:
the function's name and its arguments as the JSON text the model wrote, which grows while it is written. A
format also says which control tokens carry its markers (kept in the text so they can be read) and the grammar
that forces a call of the request's tools. Which format a model writes follows from its chat template, as
llama.cpp decides it:

- Hermes (Qwen2.5 / Qwen3, Hermes and many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; without the tags, a JSON call of one of the tools on its own (bare or in a ```json fence) counts too.
- Llama 3.x: the answer is a JSON object `{"name": ..., "parameters": {...}}` (optionally `"type": "function"`
  first; several separated by `;`), or `<|python_tag|>name.call(arg=value, ...)` for a built-in tool.
- Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}, "id": ...}` (Nemo, Small 3),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (Magistral, Devstral, Ministral; `[CALL_ID]id` before `[ARGS]` in
  Small 3.2). Its templates want 9-character alphanumeric call ids.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class Call:
    """One call in an answer: `arguments` is the JSON text of the arguments so far (all of it once `complete`);
    `streamable` False for arguments that are only known once complete (written as a JSON string, or a call
    recognised only as a whole)."""

    name: str
    arguments: str
    complete: bool
    streamable: bool = True

    def final_arguments(self) -> str:
        """The arguments as OpenAI sends them: JSON text of an object (a JSON string holding it is unwrapped)."""
        text = self.arguments.strip()
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return value if isinstance(value, str) else text


@dataclass
class Scan:
    """An answer read so far: `content` the text outside the calls that is settled (text that may still turn out
    to belong to a call is not in it yet), `calls` in order."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)


def value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i] (an object, array or string), None while it is incomplete."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        m = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null").match(text, i)
        return m.end() if m and m.end() < len(text) else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (text held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def whole_call(obj, names) -> Call | None:
    """A decoded JSON object as a call: a "name" (one of `names` when given) and its arguments under "arguments",
    "parameters" or "args" (what small models write)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (names and obj["name"] not in names):
        return None
    args = next((obj[k] for k in ("arguments", "parameters", "args") if k in obj), {})
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args), True, streamable=False)


def _decode(text: str, start: int, end: int):
    try:
        return json.loads(text[start:end])
    except ValueError:
        return None


class _Reader:
    """Reads calls whose head a regex matches (the name in group 1, the arguments' JSON value right after)."""

    def __init__(self, head: str):
        self.head = re.compile(head)

    def call_at(self, text: str, i: int, names) -> tuple[Call, int | None] | None:
        """The call whose head starts at text[i], with the end of its arguments (None while they go on); None when
        no head is there (yet)."""
        m = self.head.match(text, i)
        if m is None or (names and m.group(1) not in names):
            return None
        start = m.end()
        if start >= len(text):
            return None  # (the value's first character decides whether it can stream)
        end = value_end(text, start)
        streamable = text[start] != '"'
        arguments = text[start:end if end is not None else len(text)]
        return Call(m.group(1), arguments, end is not None, streamable), end


_SPACE = re.compile(r"\s*")


def _skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


class Hermes:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)
    _reader = _Reader(r'\s*\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*')
    _fence = re.compile(r"```[a-zA-Z]*[ \t]*\n?\s*```|```[a-zA-Z]*\s*$")

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def scan(self, text: str, names=(), final: bool = True) -> Scan:
        head = text.lstrip()
        if names and head[:1] in ("{", "`"):  # an answer that may be an untagged call
            if final:
                return self._untagged(text, set(names))
            found = self._reader.call_at(text, len(text) - len(head), names)  # a bare call streams as it comes
            return Scan(calls=[found[0]]) if found is not None else Scan()
        out, pos = Scan(), 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                tail = text[pos:]
                out.content += tail[:len(tail) - (0 if final else partial_suffix(tail, self.OPEN))]
                return out
            out.content += text[pos:start]
            body = start + len(self.OPEN)
            close = text.find(self.CLOSE, body)
            found = self._reader.call_at(text if close < 0 else text[:close], body, ())
            if close < 0:  # the block goes on
                if found is not None and (not final or found[0].complete):
                    out.calls.append(found[0])
                elif final:
                    out.content += text[start:]
                return out
            call = found[0] if found is not None and found[0].complete else None
            if call is None or not re.fullmatch(r"\s*\}\s*", text[found[1]:close]):
                obj = _decode(text, body, close)
                call = whole_call(obj, ()) if obj is not None else None
            if call is None:  # a block that is not a call stays in the text
                out.content += text[start:close + len(self.CLOSE)]
            else:
                out.calls.append(call)
            pos = close + len(self.CLOSE)

    def _untagged(self, text: str, names: set) -> Scan:
        """Tagged blocks if there are any, else JSON calls of `names` at the start of a line, bare or fenced."""
        tagged = self.scan(text, (), True)
        if tagged.calls:
            return tagged
        decoder = json.JSONDecoder()
        out, pos, i = Scan(), 0, 0
        while i < len(text):
            j = text.find("{", i)
            if j < 0:
                break
            line_start = text.rfind("\n", 0, j) + 1
            if text[line_start:j].strip() not in ("", "```json", "```"):
                i = j + 1
                continue
            found = self._reader.call_at(text, j, names)  # (the arguments as written, as they streamed)
            tail = re.compile(r"\s*\}").match(text, found[1]) if found is not None and found[1] else None
            if tail is not None:
                call, end = found[0], tail.end()
            else:
                try:
                    obj, end = decoder.raw_decode(text, j)
                except ValueError:
                    i = j + 1
                    continue
                call = whole_call(obj, names)
            if call is not None:
                out.content += text[pos:j]
                out.calls.append(call)
                pos = end
            i = end
        out.content += text[pos:]
        if out.calls:  # the fences that held the calls are empty now
            out.content = self._fence.sub("", out.content.replace("```json\n", "```\n"))
        return out

    def grammar(self, request) -> str:
        """One call in a block (several when parallel and not a named choice)."""
        block = '"<tool_call>\\n" tool-call-object "\\n</tool_call>"'
        many = request.parallel and request.choice == "required"
        return _rules(f"root ::= {block}" + (f' ("\\n" {block})*' if many else ""),
                      _call_schema(request, "arguments"))


class Llama3:
    name = "llama3"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)
    _reader = _Reader(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"([^"]+)"\s*,\s*'
                      r'"(?:parameters|arguments)"\s*:\s*')
    _builtin = re.compile(r"\s*([\w.-]+?)\s*\.\s*call\s*\(")
    _arg_name = re.compile(r"\s*(\w+)\s*=\s*")

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def scan(self, text: str, names=(), final: bool = True) -> Scan:
        i = _skip_space(text, 0)
        rest = text[i:]
        if not final and (not rest or (self.PYTHON_TAG.startswith(rest))):
            return Scan()
        if rest.startswith(self.PYTHON_TAG):
            i = _skip_space(text, i + len(self.PYTHON_TAG))
            if not text.startswith("{", i):
                return self._builtin_call(text, i) if final else Scan()
        elif not rest.startswith("{"):
            return Scan(content=text)  # an answer that does not start with a call is text
        out = Scan()
        while text.startswith("{", i):
            found = self._reader.call_at(text, i, names)
            if found is not None:
                call, end = found
                if end is not None:
                    m = re.compile(r"\s*\}").match(text, end)
                    end = m.end() if m else None
            else:
                end = value_end(text, i)
                if end is None and not final:
                    return out
                call = whole_call(_decode(text, i, end), names) if end is not None else None
                if call is None:  # JSON that is not a call: the whole answer is text
                    return Scan(content=text) if not out.calls else Scan(content=text[i:], calls=out.calls)
            if end is None:
                if not final:
                    out.calls.append(call)
                else:
                    out.content += text[i:]
                return out
            out.calls.append(call)
            i = _skip_space(text, end)
            if text.startswith(";", i):
                i = _skip_space(text, i + 1)
        if final or i < len(text):
            out.content += text[i:]
        return out

    def _builtin_call(self, text: str, i: int) -> Scan:
        """`name.call(query="...", ...)`: the arguments as a JSON object."""
        m = self._builtin.match(text, i)
        if m is None:
            return Scan(content=text)
        decoder, args, j = json.JSONDecoder(), {}, m.end()
        while (a := self._arg_name.match(text, j)) is not None:
            try:
                args[a.group(1)], j = decoder.raw_decode(text, a.end())
            except ValueError:
                return Scan(content=text)
            j = _skip_space(text, j)
            if not text.startswith(",", j):
                break
            j += 1
        if not text.startswith(")", j):
            return Scan(content=text)
        return Scan(content=text[j + 1:], calls=[Call(m.group(1), json.dumps(args), True, streamable=False)])

    def grammar(self, request) -> str:
        """One JSON call object (the Llama 3.x templates render one call per message)."""
        return _rules("root ::= tool-call-object", _call_schema(request, "parameters"))


class Mistral:
    name = "mistral"
    MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (MARK, ARGS, CALL_ID)
    _reader = _Reader(r'\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*')
    _named = _Reader(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")
    _tail = re.compile(r'(?:\s*,\s*"id"\s*:\s*"[^"]*")?\s*\}')

    def __init__(self, named_form: bool = False):
        self.named_form = named_form  # [TOOL_CALLS]name[ARGS]{...} rather than the JSON array

    def new_id(self) -> str:
        return uuid.uuid4().hex[:9]

    def scan(self, text: str, names=(), final: bool = True) -> Scan:
        start = text.find(self.MARK)
        if start < 0:
            head = _skip_space(text, 0)
            if names and text.startswith("[", head):  # the array without its marker (a decoder that drops it)
                array = self._array(text, head, names, final)
                if array is not None:
                    return array
            keep = 0 if final else partial_suffix(text, self.MARK)
            return Scan(content=text[:len(text) - keep])
        body = _skip_space(text, start + len(self.MARK))
        if text.startswith("[", body):
            out = self._array(text, body, (), final)
            if out is None:
                return Scan(content=text) if final else Scan(content=text[:start])
        else:
            out = self._named_calls(text, start, final)
        out.content = text[:start] + out.content
        return out

    def _array(self, text: str, i: int, names, final: bool) -> Scan | None:
        """Calls of a JSON array from text[i] ("["); None when it is not an array of calls."""
        out, j = Scan(), _skip_space(text, i + 1)
        while j < len(text):
            found = self._reader.call_at(text, j, names)
            if found is None:
                end = value_end(text, j) if text.startswith("{", j) else None
                if end is None:
                    return out if not final and (out.calls or text.startswith("{", j) or j == len(text)) else None
                call = whole_call(_decode(text, j, end), names)
                if call is None:
                    return None
            else:
                call, end = found
                if end is None:
                    if final:
                        return None
                    out.calls.append(call)
                    return out
                m = self._tail.match(text, end)
                if m is None:
                    return None if final else out
                end = m.end()
            out.calls.append(call)
            j = _skip_space(text, end)
            if text.startswith(",", j):
                j = _skip_space(text, j + 1)
            elif text.startswith("]", j):
                out.content = text[j + 1:]
                return out
            elif j < len(text):
                return None
        return None if final else out

    def _named_calls(self, text: str, i: int, final: bool) -> Scan:
        out = Scan()
        while text.startswith(self.MARK, i):
            found = self._named.call_at(text, i + len(self.MARK), ())
            if found is None or (found[1] is None and final):
                if final:
                    out.content += text[i:]
                return out
            call, end = found
            out.calls.append(call)
            if end is None:
                return out
            i = _skip_space(text, end)
        rest = text[i:]
        out.content += rest[:len(rest) - (0 if final else partial_suffix(rest, self.MARK))]
        return out

    def grammar(self, request) -> str:
        if self.named_form:
            tools = _forced_tools(request)
            alternatives, rules = [], []
            for k, t in enumerate(tools):
                body = _schema_rules(t["function"].get("parameters") or {"type": "object"}, f"args{k}")
                rules.append(body)
                alternatives.append(f'{json.dumps(t["function"]["name"])} "[ARGS]" args{k}')
            call = '"[TOOL_CALLS]" (' + " | ".join(alternatives) + ")"
            many = request.parallel and request.choice == "required"
            return "\n".join([f"root ::= {call}" + (f" ({call})*" if many else "")] + rules)
        schema = _call_schema(request, "arguments", extra={"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
        array = {"type": "array", "items": schema, "minItems": 1}
        if not (request.parallel and request.choice == "required"):
            array["maxItems"] = 1
        return _rules('root ::= "[TOOL_CALLS]" tool-call-object', array)


def for_template(template: str | None):
    """The format a chat template's model writes (Hermes when the template says nothing that picks another)."""
    src = template or ""
    if "[TOOL_CALLS]" in src:
        return Mistral(named_form="[ARGS]" in src)
    if "<|start_header_id|>" in src and ("ipython" in src or "<|python_tag|>" in src):
        return Llama3()
    return Hermes()


# -- grammars of forced calls (llama-cpp-python's JSON-schema converter) ---------------------------
def _forced_tools(request) -> list[dict]:
    return [t for t in request.tools if request.choice == "required" or t["function"]["name"] == request.choice]


def _call_schema(request, arguments_key: str, extra: dict | None = None) -> dict:
    calls = []
    for t in _forced_tools(request):
        properties = {"name": {"const": t["function"]["name"]},
                      arguments_key: t["function"].get("parameters") or {"type": "object"}, **(extra or {})}
        calls.append({"type": "object", "properties": properties, "required": list(properties)})
    return calls[0] if len(calls) == 1 else {"oneOf": calls}


def _schema_rules(schema: dict, prefix: str) -> str:
    """GBNF of a JSON schema whose rules are all named `prefix-...` (its root: `prefix`), so the rules of several
    schemas can share one grammar."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    gbnf = json_schema_to_gbnf(json.dumps(schema))
    names = set(re.findall(r"^([\w-]+) ::=", gbnf, flags=re.M))
    rename = lambda m: (prefix if m.group(0) == "root" else f"{prefix}-{m.group(0)}") \
        if m.group(0) in names else m.group(0)  # noqa: E731
    # rule names outside the literals ("...") and character classes ([...]) of the grammar
    parts = re.split(r'("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\])', gbnf)
    return "".join(part if k % 2 else re.sub(r"[A-Za-z][\w-]*", rename, part) for k, part in enumerate(parts))


def _rules(root: str, schema: dict) -> str:
    """`root` with the rules of a call's JSON schema as `tool-call-object`."""
    return root + "\n" + _schema_rules(schema, "tool-call-object")
