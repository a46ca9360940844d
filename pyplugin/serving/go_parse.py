"""Go's text/template, parsed: the lexer and parser behind go_template.py.

The grammar is Go's: text and {{ actions }} with '-' trim markers and comments; pipelines of commands
joined by '|', each a function call or a single operand (fields `.A.B`, variables `$x.A`, `$`, `.`,
string, raw-string, number and bool literals, `nil`, a parenthesised pipeline with fields after it);
variable declarations (`$x := ...`, `$i, $v := range ...`) and assignments (`$x = ...`); `if`, `else if`,
`range`, `with`, `else with`, `break`, `continue`, `end`. `define`, `template` and `block` are refused by
name: no template Ollama ships uses them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Union

from ..errors import OptionsError


class TemplateSyntaxError(OptionsError):
    """A Go template that does not parse, or uses what pebbling does not implement."""


# -- nodes --------------------------------------------------------------------------------------------

@dataclass
class Field:          # .A.B on `receiver` (None: on dot), or $x.A.B (receiver a Variable)
    names: tuple[str, ...]
    receiver: Any = None


@dataclass
class Variable:
    name: str         # "$" for the data the template was given


@dataclass
class Literal:
    value: Any


@dataclass
class Dot:
    pass


@dataclass
class Identifier:     # a function name
    name: str


@dataclass
class Command:
    args: list


@dataclass
class Pipe:
    commands: list[Command]
    decl: tuple[str, ...] = ()   # variables declared (:=) or assigned (=)
    assign: bool = False


@dataclass
class Action:
    pipe: Pipe


@dataclass
class Branch:         # if / range / with
    kind: str
    pipe: Pipe
    body: list = field(default_factory=list)
    otherwise: list | None = None


@dataclass
class Loop:           # break / continue
    kind: str


Node = Union[str, Action, Branch, Loop]

# -- lexer ---------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<declare>:=)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\\n]|\\.)+')
  | (?P<number>[-+]?(?:0[xX][0-9a-fA-F_]+|(?:\d[\d_]*)?\.?\d[\d_]*(?:[eE][-+]?\d+)?))
  | (?P<variable>\$\w*)
  | (?P<field>(?:\.\w+)+)
  | (?P<dot>\.)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<punct>[()|=,])
""", re.X)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "a": "\a", "b": "\b",
            "f": "\f", "v": "\v", "0": "\0"}


def _unquote(body: str) -> str:
    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "xuU":
            return chr(int(e[1:], 16))
        return _ESCAPES.get(e, e)
    return re.sub(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", one, body)


def _pieces(source: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)], trim markers applied, comments dropped."""
    out: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    while True:
        start = source.find("{{", pos)
        text = source[pos:] if start < 0 else source[pos:start]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if start < 0:
            out.append(("text", text))
            return out
        trim_before = source.startswith("{{- ", start) or source.startswith("{{-\t", start) or \
            source.startswith("{{-\n", start) or source.startswith("{{-\r", start)
        if trim_before:
            text = text.rstrip(" \t\r\n")
        out.append(("text", text))
        body_start = start + (3 if trim_before else 2)
        end = _action_end(source, body_start)
        body = source[body_start:end]
        trim_next = body.endswith(" -") or body.endswith("\t-") or body.endswith("\n-") or body.endswith("\r-")
        if trim_next:
            body = body[:-2]
        stripped = body.strip()
        if stripped.startswith("/*"):
            if not stripped.endswith("*/"):
                raise TemplateSyntaxError("template: a comment must end with */ right before }}")
        else:
            out.append(("action", body))
        pos = end + 2


def _action_end(source: str, i: int) -> int:
    """Where the action that starts at i ends ('}}' outside quotes; a comment's text is skipped)."""
    comment = re.compile(r"\s*/\*").match(source, i)
    if comment:
        close = source.find("*/", comment.end())
        if close < 0:
            raise TemplateSyntaxError("template: a comment (/*) is not closed (*/)")
        i = close + 2
    quote = None
    while i < len(source):
        c = source[i]
        if quote:
            if c == "\\" and quote != "`":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif source.startswith("}}", i):
            return i
        i += 1
    raise TemplateSyntaxError("template: an action ({{) is not closed (}})")


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if not m:
            raise TemplateSyntaxError(f"template: cannot read {body[pos:pos + 20]!r} in {{{{{body.strip()[:60]}}}}}")
        pos = m.end()
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
    return out


# -- parser --------------------------------------------------------------------------------------------

_UNSUPPORTED = {"define", "template", "block"}
# if/range/with (else-if chains included) and parentheses nest at most this deep: far past any template a
# model ships (Ollama's nest five or six), and the parser and executor recurse once per level.
MAX_DEPTH = 100
_INT64 = 1 << 63


def _deeper(depth: int, what: str) -> int:
    if depth >= MAX_DEPTH:
        raise TemplateSyntaxError(f"template: {what} nested more than {MAX_DEPTH} deep; "
                                  f"a template may nest at most {MAX_DEPTH} levels")
    return depth + 1


def parse(source: str) -> list[Node]:
    """The template's node list; TemplateSyntaxError naming what is wrong."""
    stack: list[tuple[Branch | None, list, int]] = [(None, [], 0)]  # (branch, its open list, depth)
    for kind, body in _pieces(source):
        nodes, depth = stack[-1][1], stack[-1][2]
        if kind == "text":
            if body:
                nodes.append(body)
            continue
        tokens = _tokens(body)
        if not tokens:
            raise TemplateSyntaxError("template: an empty action {{ }}")
        word = tokens[0][1] if tokens[0][0] == "ident" else None
        if word in _UNSUPPORTED:
            raise TemplateSyntaxError(f"template: {{{{ {word} }}}} is not supported by pebbling (nested templates)")
        if word in ("if", "range", "with"):
            branch = Branch(word, _pipe(tokens[1:], allow_decl=True))
            nodes.append(branch)
            stack.append((branch, branch.body, _deeper(depth, "{{ if }}, {{ range }} and {{ with }} are")))
        elif word == "else":
            branch = stack[-1][0]
            if branch is None or branch.otherwise is not None:
                raise TemplateSyntaxError("template: {{ else }} outside an if, range or with")
            branch.otherwise = []
            if len(tokens) > 1:  # else if / else with: a branch nested in the else list, closed by one end
                inner_word = tokens[1][1]
                if inner_word not in ("if", "with") or inner_word != branch.kind and branch.kind != "if":
                    raise TemplateSyntaxError(f"template: {{{{ else {inner_word} }}}} in a {branch.kind}")
                inner = Branch(inner_word, _pipe(tokens[2:], allow_decl=True))
                branch.otherwise.append(inner)
                stack[-1] = (inner, inner.body, _deeper(depth, "{{ else if }} chains are"))
            else:
                stack[-1] = (branch, branch.otherwise, depth)
        elif word == "end":
            if len(stack) == 1:
                raise TemplateSyntaxError("template: {{ end }} without an if, range or with")
            stack.pop()
        elif word in ("break", "continue"):
            nodes.append(Loop(word))
        else:
            nodes.append(Action(_pipe(tokens, allow_decl=True)))
    if len(stack) > 1:
        raise TemplateSyntaxError(f"template: an {{{{ {stack[-1][0].kind} }}}} has no {{{{ end }}}}")
    return stack[0][1]


def _pipe(tokens: list[tuple[str, str]], allow_decl: bool) -> Pipe:
    decl: tuple[str, ...] = ()
    assign = False
    # $x := ... ; $i, $v := ... ; $x = ...
    for n in (1, 3):
        if len(tokens) > n and tokens[n][0] in ("declare", "punct") and tokens[n][1] in (":=", "=") and \
                all(t[0] == "variable" for t in tokens[0:n:2]) and (n == 1 or tokens[1] == ("punct", ",")):
            if not allow_decl:
                raise TemplateSyntaxError("template: a variable may not be declared here")
            decl, assign, tokens = tuple(t[1] for t in tokens[0:n:2]), tokens[n][1] == "=", tokens[n + 1:]
            break
    commands, depth = [], 0
    groups: list[list] = [[]]
    for token in tokens:
        if token == ("punct", "("):
            depth += 1
            if depth > MAX_DEPTH:
                _deeper(depth, "parentheses are")
        elif token == ("punct", ")"):
            depth -= 1
        if token == ("punct", "|") and depth == 0:
            groups.append([])
        else:
            groups[-1].append(token)
    for group in groups:
        if not group:
            raise TemplateSyntaxError("template: an empty command in a pipeline")
        commands.append(Command(_operands(group)))
    return Pipe(commands, decl, assign)


def _number(text: str) -> int | float:
    """A number literal: an int where it fits Go's int64, else a float (as Go reads 1e20), never infinite."""
    clean = text.replace("_", "")
    is_hex = clean.lower().lstrip("+-").startswith("0x")
    if len(clean) > 400:  # past any float's digits; int() of thousands of digits is slow and refused
        raise TemplateSyntaxError(f"template: number {text[:20]}... is out of range")
    try:
        value: int | float = float(clean) if re.search(r"[.eE]", clean) and not is_hex else int(clean, 0)
    except ValueError:
        raise TemplateSyntaxError(f"template: bad number syntax: {text[:40]!r}") from None
    try:
        if isinstance(value, int) and not -_INT64 <= value < _INT64:
            value = float(value)
    except OverflowError:
        value = float("inf")
    if value in (float("inf"), float("-inf")):
        raise TemplateSyntaxError(f"template: number {text[:40]} is out of range")
    return value


def _operands(tokens: list[tuple[str, str]]) -> list:
    out, i = [], 0
    while i < len(tokens):
        kind, text = tokens[i]
        i += 1
        if kind == "punct" and text == "(":
            depth, j = 1, i
            while j < len(tokens) and depth:
                depth += {"(": 1, ")": -1}.get(tokens[j][1], 0) if tokens[j][0] == "punct" else 0
                j += 1
            if depth:
                raise TemplateSyntaxError("template: a '(' is not closed")
            node: Any = _pipe(tokens[i:j - 1], allow_decl=False)
            i = j
            if i < len(tokens) and tokens[i][0] == "field":  # (pipeline).Field
                node = Field(tuple(tokens[i][1][1:].split(".")), node)
                i += 1
            out.append(node)
        elif kind == "field":
            out.append(Field(tuple(text[1:].split("."))))
        elif kind == "variable":
            if i < len(tokens) and tokens[i][0] == "field":
                out.append(Field(tuple(tokens[i][1][1:].split(".")), Variable(text)))
                i += 1
            else:
                out.append(Variable(text))
        elif kind == "dot":
            out.append(Dot())
        elif kind == "string":
            out.append(Literal(_unquote(text[1:-1])))
        elif kind == "raw":
            out.append(Literal(text[1:-1]))
        elif kind == "char":
            out.append(Literal(ord(_unquote(text[1:-1]))))
        elif kind == "number":
            out.append(Literal(_number(text)))
        elif kind == "ident":
            out.append(Literal({"true": True, "false": False}[text]) if text in ("true", "false") else
                       Literal(None) if text == "nil" else Identifier(text))
        else:
            raise TemplateSyntaxError(f"template: unexpected {text!r}")
    return out
