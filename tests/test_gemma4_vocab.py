"""Gemma 4's tokenizer ("gemma4") against an independent re-implementation of llama.cpp's algorithm, the
synthetic Gemma 4 vocabulary, and its chat template's text."""

from __future__ import annotations

import re

import pytest

from helpers import tiny_model
from pyplugin.errors import ModelError
from pyplugin.model import ChatTemplate, Tokenizer
from pyplugin.model.synth_vocab import CORPUS, build_vocab
from pyplugin.model.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED

TEXTS = [
    "Hello world", " Hello world", "  two leading", "trailing  ", "   ", " ", "",
    "multiple   spaces\tand a tab", "\n", "\n\n", "\n\n\n", "\n\n\n\n", "\n\n\n\n\n", "\n" * 7, "\n" * 11,
    "a\n\n\n\nb", "line one\nline two\n\nline four\n\n\n\n\nend", "\r\n\r\n", " \n \n\t\n",
    "héllo wörld 日本語 🙂", "🦙 llamas 🚀 😶‍🌫️ 👩‍👩‍👧 🇫🇷 need bytes",
    "\x00\x01\x7f control bytes",
    "€ ℵ Ω ё unseen characters", "a literal ▁ lower one eighth block ▁▁", "non\u00a0breaking\u3000spaces",
    "It's 12345 dollars, isn't it? We'll see; they're $42.50", "def f(x):\n    return x + 1\n",
    "<|turn>user\nHi there<turn|>\n<|turn>model\n", "<|channel>thought\nhmm<channel|>The answer.",
    '<|tool_call>call:add{a:2,b:<|"|>three<|"|>}<tool_call|><|tool_response>', "<|tur and <turn| half tokens",
    "<0x41> is text, not a byte", "<unk> and <mask> and <pad>", "x<eos>y<bos>z", "<turn|><turn|>\n\n\n\n<|turn>",
    CORPUS, " ".join(reversed(CORPUS.split())), "\n\n".join(CORPUS.splitlines()),
]


def gemma4_tokenizer(n_merges: int = 300, add_bos: bool | None = True) -> tuple[Tokenizer, object]:
    v = build_vocab("gemma4", n_merges)
    md = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": v.tokens, "tokenizer.ggml.token_type": v.types,
          "tokenizer.ggml.merges": v.merges, "tokenizer.ggml.scores": v.scores,
          "tokenizer.ggml.bos_token_id": v.bos_id, "tokenizer.ggml.eos_token_id": v.eos_id,
          "tokenizer.ggml.unknown_token_id": v.unk_id}
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = add_bos
    return Tokenizer.from_metadata(md, "gemma4.gguf"), v


def reference(v, text: str) -> list[int]:
    """llama.cpp's Gemma 4 tokenization, written out plainly: special tokens cut out of the text (longest
    first), each stretch between them with spaces as '▁', split into runs of newlines and runs of anything
    else; a newline run that is a token is that token; otherwise the pair of lowest merge rank is merged
    (leftmost first) until none is left, and a piece outside the vocabulary becomes its UTF-8 bytes' <0xNN>."""
    ids = {}
    for i, t in enumerate(v.tokens):
        ids.setdefault(t, i)
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(v.merges)}
    specials = sorted((t for t, ty in zip(v.tokens, v.types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)),
                      key=len, reverse=True)
    pieces: list[object] = [text]
    for special in specials:
        cut: list[object] = []
        for piece in pieces:
            if not isinstance(piece, str):
                cut.append(piece)
                continue
            for n, part in enumerate(piece.split(special)):
                if n:
                    cut.append(ids[special])
                if part:
                    cut.append(part)
        pieces = cut
    out = [v.bos_id]
    for piece in pieces:
        if not isinstance(piece, str):
            out.append(piece)
            continue
        for word in re.findall(r"[^\n]+|\n+", piece.replace(" ", "\u2581")):
            if set(word) == {"\n"} and word in ids:
                out.append(ids[word])
                continue
            symbols = list(word)
            while True:
                pairs = [(ranks[p], k) for k, p in enumerate(zip(symbols, symbols[1:])) if p in ranks]
                if not pairs:
                    break
                _, k = min(pairs)
                symbols[k:k + 2] = [symbols[k] + symbols[k + 1]]
            for s in symbols:
                out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


@pytest.mark.parametrize("n_merges", [20, 300, 1200])
def test_encoding_matches_llama_cpps_algorithm(n_merges):
    tok, v = gemma4_tokenizer(n_merges)
    for text in TEXTS:
        assert tok.encode(text) == reference(v, text), repr(text)


def test_round_trip():
    tok, v = gemma4_tokenizer()
    hidden = sorted((t for i, t in enumerate(v.tokens) if tok.is_special(i)), key=len, reverse=True)
    for text in TEXTS:
        if "\u2581" in text:  # a literal '▁' comes back a space, as from llama.cpp
            assert tok.decode(tok.encode(text)) == text.replace("\u2581", " ")
            continue
        assert tok.decode(tok.encode(text, add_bos=False), special=True) == text, repr(text)
        assert tok.decode(tok.encode(text)) == re.sub("|".join(map(re.escape, hidden)), "", text), repr(text)


def test_a_run_of_newlines_that_is_a_token_is_taken_whole():
    tok, v = gemma4_tokenizer()
    merged = {m.replace(" ", "") for m in v.merges}
    runs = [t for t in v.tokens if t and not t.strip("\n")]
    assert len(runs) >= 3 and not merged & set(runs)  # no merge makes them: only the rule does
    for run in runs:
        assert tok.encode(run, add_bos=False) == [v.tokens.index(run)]
    missing = next(n for n in range(2, 12) if "\n" * n not in runs)  # not a token: merged from single newlines
    assert tok.encode("\n" * missing, add_bos=False) == [v.tokens.index("\n")] * missing


def test_spaces_are_pieces_and_no_space_is_prefixed():
    tok, v = gemma4_tokenizer()
    ids = tok.encode("Hello world", add_bos=False)
    assert "".join(v.tokens[i] for i in ids) == "Hello\u2581world"
    assert tok.add_space_prefix is False


def test_characters_outside_the_vocabulary_fall_back_to_bytes():
    tok, v = gemma4_tokenizer()
    assert "🦙" not in v.tokens
    ids = tok.encode("🦙", add_bos=False)
    assert [v.tokens[i] for i in ids] == [f"<0x{b:02X}>" for b in "🦙".encode()]
    assert all(v.types[i] == BYTE for i in ids)
    assert tok.decode(ids) == "🦙"


def test_bos_is_added_even_where_the_file_says_not_to():
    for add_bos in (False, None, True):
        tok, v = gemma4_tokenizer(add_bos=add_bos)
        assert tok.encode("Hi")[0] == v.bos_id
        assert tok.encode("Hi", add_bos=False)[0] != v.bos_id


def test_special_tokens_and_the_shown_ones():
    tok, v = gemma4_tokenizer()
    turn, channel = v.tokens.index("<|turn>"), v.tokens.index("<|channel>")
    ids = tok.encode("<|turn>model\n<|channel>", add_bos=False)
    assert (ids[0], ids[-1]) == (turn, channel) and turn not in ids[1:-1] and channel not in ids[1:-1]
    # the channel and call markers are shown in the reply (its parser reads them); the turn markers are not
    for text in ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<tool_response|>", '<|"|>'):
        assert tok.decode([v.tokens.index(text)]) == text
    for text in ("<|turn>", "<turn|>", "<bos>", "<|think|>", "<|tool_response>"):
        assert tok.decode([v.tokens.index(text)]) == ""
        assert tok.decode([v.tokens.index(text)], special=True) == text


def test_end_of_generation_tokens():
    tok, v = gemma4_tokenizer()
    assert {v.tokens[i] for i in tok.eog_ids} == {"<eos>", "<turn|>", "<|tool_response>"}


def test_vocabulary_checks():
    _, v = gemma4_tokenizer()
    md = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": v.tokens}
    with pytest.raises(ModelError, match="x.gguf: BPE tokenizer without 'tokenizer.ggml.merges'"):
        Tokenizer.from_metadata(md, "x.gguf")
    with pytest.raises(ModelError, match=r"merges'\[1\] is 'zz▁ q'"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.merges": [v.merges[0], "zz▁ q"]}, "x.gguf")
    # a merge is cut at its first space after the first character (a piece may start with a space)
    tokens = [*v.tokens, " a", "b", " ab"]
    tok = Tokenizer.from_metadata({**md, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [" a b"]},
                                  "x.gguf")
    assert tok.kind == "gemma4"


def test_synthetic_model_carries_the_vocabulary_and_template():
    model = tiny_model("llama", vocab="gemma4")
    tok = model.tokenizer
    assert tok.kind == "gemma4" and tok.bos_token == "<bos>" and tok.eos_token == "<eos>"
    assert tok.decode(tok.encode(CORPUS)) == CORPUS
    types = build_vocab("gemma4").types
    assert {CONTROL, USER_DEFINED, UNKNOWN, BYTE, NORMAL} <= set(types)


# ---------------------------------------------------------------------------------------------------
# the chat template: Gemma 4's format, written out by hand


def render(messages, **extra):
    return ChatTemplate(build_vocab("gemma4").chat_template, bos_token="<bos>").render(messages, **extra)


ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "first"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}


def test_template_plain_chat():
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi\n"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert render(messages) == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
                                "Hello!<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    assert render(messages[1:2], add_generation_prompt=False) == "<bos><|turn>user\nHi<turn|>\n"


def test_template_thinking_switch():
    user = [{"role": "user", "content": "Hi"}]
    assert render(user, enable_thinking=True) == \
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    assert render(user, enable_thinking=False) == \
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    # an earlier reply's thinking is not passed back
    earlier = [*user, {"role": "assistant", "content": "<|channel>thought\nhmm<channel|>Hello"}, *user]
    assert "hmm" not in render(earlier) and "<|turn>model\nHello<turn|>\n" in render(earlier)


def test_template_tools_calls_and_results():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"b": 3, "a": 2}}}
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "", "reasoning_content": "use add", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    declaration = ('<|tool>declaration:add{description:<|"|>Add two numbers<|"|>,parameters:{properties:{'
                   'a:{description:<|"|>first<|"|>,type:<|"|>INTEGER<|"|>},b:{type:<|"|>INTEGER<|"|>}},'
                   'required:[<|"|>a<|"|>,<|"|>b<|"|>],type:<|"|>OBJECT<|"|>}}<tool|>')
    assert render(messages[:1], tools=[ADD]) == (
        f"<bos><|turn>system\n{declaration}<turn|>\n<|turn>user\n2+3?<turn|>\n<|turn>model\n"
        "<|channel>thought\n<channel|>")
    # a call awaiting its result ends with <|tool_response>; with the result the turn goes on
    assert render(messages[:2], tools=[ADD]).endswith(
        "<|turn>model\n<|channel>thought\nuse add\n<channel|><|tool_call>call:add{a:2,b:3}<tool_call|><|tool_response>")
    assert render(messages, tools=[ADD]).endswith(
        "<|turn>model\n<|channel>thought\nuse add\n<channel|><|tool_call>call:add{a:2,b:3}<tool_call|>"
        '<|tool_response>response:add{value:<|"|>5<|"|>}<tool_response|>')
    answered = [*messages, {"role": "assistant", "content": "It is 5."}]
    assert render(answered, tools=[ADD]).endswith(
        '<tool_response|>It is 5.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>')


def test_template_argument_notation():
    call = {"type": "function", "function": {"name": "f", "arguments": {
        "s": "x", "t": True, "n": 1.5, "l": ["a", 2], "o": {"k": False}}}}
    text = render([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert '<|tool_call>call:f{l:[<|"|>a<|"|>,2],n:1.5,o:{k:false},s:<|"|>x<|"|>,t:true}<tool_call|>' in text
