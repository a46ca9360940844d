"""Tokenizers built from GGUF metadata, the streaming detokenizer and chat templates."""

from __future__ import annotations

import math

import pytest
from gguf import GGUFReader
from tokenizers import Regex, pre_tokenizers

from helpers import tiny_model, tiny_path
from pyplugin.errors import ModelError
from pyplugin.model import ChatTemplate, ChatTemplateError, Tokenizer
from pyplugin.model.tokenizer import CONTROL, NORMAL, PRE_TOKENIZERS, SPACE, bytes_to_unicode
from pyplugin.model.synth import CORPUS

TEXTS = [
    "héllo wörld 日本語 🙂",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  multiple   spaces\tand\nnew lines\n\n",
    "It's 12345 dollars, isn't it? We'll see; they're $42.50",
    "def f(x):\n    return x + 1\n",
    "€ ℵ Ω unseen characters",
    CORPUS,
    " ".join(reversed(CORPUS.split())),
]
BPE_FLAVOURS = [("llama3", None), ("chatml", None), ("llama3", "gpt2"), ("llama3", "smollm"),
                ("llama3", "default")]


def bpe_model(vocab, pre):
    return tiny_model("llama", vocab=vocab, **({"pre": pre} if pre else {}))


# ---------------------------------------------------------------------------------------------------
# independent re-implementations of llama.cpp's two algorithms


def spm_reference(tok: Tokenizer, scores: list[float], text: str) -> list[int]:
    """llama.cpp's llm_tokenizer_spm: start from characters, repeatedly merge the adjacent pair whose
    concatenation is the highest-scoring token (leftmost on ties), then bytes for what is left."""
    vocab = {}
    for i, t in enumerate(tok.tokens):
        vocab.setdefault(t, i)
    symbols = list((" " + text).replace(" ", SPACE))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in vocab and (best is None or scores[vocab[joined]] > best[0]):
                best = (scores[vocab[joined]], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids = []
    for s in symbols:
        ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
    return ids


def bpe_reference(tok: Tokenizer, merges: list[str], text: str, pre: str) -> list[int]:
    """Rank-ordered BPE merges within each pre-token (llama.cpp's llm_tokenizer_bpe)."""
    spec = PRE_TOKENIZERS[pre]
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab = {t: i for i, t in enumerate(tok.tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    ids = []
    for word, _ in split.pre_tokenize_str(text):
        if spec.ignore_merges and word in vocab:
            ids.append(vocab[word])
            continue
        parts = list(word)
        while len(parts) > 1:
            rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:])))
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [vocab[p] for p in parts]
    return ids


@pytest.mark.parametrize("vocab,pre", BPE_FLAVOURS)
def test_bpe_encoding_matches_rank_ordered_merges(vocab, pre):
    tok = bpe_model(vocab, pre).tokenizer
    fields = GGUFReader(tiny_path("llama", vocab=vocab, **({"pre": pre} if pre else {}))).fields
    merges = fields["tokenizer.ggml.merges"].contents()
    name = fields["tokenizer.ggml.pre"].contents()
    for text in TEXTS:
        assert tok.encode(text, add_bos=False) == bpe_reference(tok, merges, text, name), text


def test_llama3_pre_tokenizer_takes_whole_words_from_the_vocabulary():
    # 'abc' is a token no merge leads to: llama.cpp's ignore_merges (llama-bpe) still uses it whole.
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["ab", "abc", "<|end|>"]
    types = [NORMAL] * 258 + [CONTROL]
    llama3 = Tokenizer(tokens, types, kind="bpe", merges=["a b"], pre="llama-bpe", add_bos=False)
    gpt2 = Tokenizer(tokens, types, kind="bpe", merges=["a b"], pre="gpt2", add_bos=False)
    assert llama3.encode("abc") == [257]
    assert gpt2.encode("abc") == [256, ord("c")]


def test_spm_encoding_matches_llama_cpp_algorithm():
    tok = tiny_model("phi3").tokenizer
    scores = GGUFReader(tiny_path("phi3")).fields["tokenizer.ggml.scores"].contents()
    for text in TEXTS:
        assert tok.encode(text, add_bos=False) == spm_reference(tok, scores, text), text


def test_spm_prefixes_a_space_after_each_special_token_like_llama_cpp():
    # A Phi-3 model (general.name says phi3): llama.cpp also drops the newline after each special token.
    tok = tiny_model("phi3").tokenizer
    scores = GGUFReader(tiny_path("phi3")).fields["tokenizer.ggml.scores"].contents()
    user, end = tok.tokens.index("<|user|>"), tok.tokens.index("<|end|>")
    expected = [tok.bos_id, user] + spm_reference(tok, scores, "hello world") + [end]
    assert tok.encode("<|user|>\nhello world<|end|>\n") == expected


def test_spm_keeps_whitespace_after_special_tokens_unless_the_model_is_phi3():
    tok = tiny_model("llama", vocab="spm").tokenizer    # same vocabulary, general.name without phi3
    scores = GGUFReader(tiny_path("llama", vocab="spm")).fields["tokenizer.ggml.scores"].contents()
    assert not tok.rstrip_ids
    user, end = tok.tokens.index("<|user|>"), tok.tokens.index("<|end|>")
    expected = ([tok.bos_id, user] + spm_reference(tok, scores, "\nhello world") + [end]
                + spm_reference(tok, scores, "\n"))
    assert tok.encode("<|user|>\nhello world<|end|>\n") == expected


def test_phi3_strips_whitespace_after_special_tokens_like_llama_cpp():
    """llama.cpp gives Phi-3's special tokens the RSTRIP attribute, except <unk>, <s> and
    <|endoftext|>: the text after one loses its leading ' \\t\\n\\v\\f\\r' (isspace), all of it,
    and no other whitespace."""
    tok = tiny_model("phi3").tokenizer
    scores = GGUFReader(tiny_path("phi3")).fields["tokenizer.ggml.scores"].contents()
    ids = {t: tok.tokens.index(t) for t in ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>",
                                           "<|end|>", "<|system|>", "<|endoftext|>")}
    assert tok.rstrip_ids == {ids[t] for t in ("</s>", "<|user|>", "<|assistant|>", "<|end|>",
                                               "<|system|>")}

    def ref(text):
        return spm_reference(tok, scores, text)

    # the whole Phi-3 chat template: no newline survives a special token; whitespace-only gaps vanish
    prompt = "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n"
    assert tok.encode(prompt) == ([tok.bos_id, ids["<|system|>"]] + ref("Be brief.") + [ids["<|end|>"]]
                                  + [ids["<|user|>"]] + ref("Hi there") + [ids["<|end|>"]]
                                  + [ids["<|assistant|>"]])
    assert tok.encode("<|user|> \t\n\v\f\r hi", add_bos=False) == [ids["<|user|>"]] + ref("hi")
    assert tok.encode("</s>  x", add_bos=False) == [ids["</s>"]] + ref("x")
    # only C whitespace goes: U+00A0 and U+3000 stay (the tokenizers library's rstrip would take them)
    assert tok.encode("<|end|>\u00a0x", add_bos=False) == [ids["<|end|>"]] + ref("\u00a0x")
    assert tok.encode("<|end|>\n\u3000x", add_bos=False) == [ids["<|end|>"]] + ref("\u3000x")
    # whitespace before a special token stays
    assert tok.encode("a \n<|end|>", add_bos=False) == ref("a \n") + [ids["<|end|>"]]
    # <unk>, <s> and <|endoftext|> keep what follows them
    for name in ("<unk>", "<s>", "<|endoftext|>"):
        assert tok.encode(name + "\n x", add_bos=False) == [ids[name]] + ref("\n x"), name


@pytest.mark.parametrize("name,strips", [
    ("Phi-3-mini-4k-instruct", True), ("PHI3.5 mini", True), ("my-phi3-finetune", True),
    ("Phi 3", False), ("Phi-2", False), ("Llama 3", False), ("", False)])
def test_phi3_rule_follows_llama_cpps_name_match(name, strips):
    # llama.cpp lowercases general.name and looks for "phi-3" or "phi3" in it.
    spm = tiny_model("phi3").tokenizer
    tok = Tokenizer(spm.tokens, spm.types, kind="spm", bos_id=spm.bos_id, name=name)
    assert bool(tok.rstrip_ids) == strips
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": spm.tokens,
          "tokenizer.ggml.token_type": spm.types, "general.name": name}
    assert bool(Tokenizer.from_metadata(md, "x.gguf").rstrip_ids) == strips


# ---------------------------------------------------------------------------------------------------
# round trips and special tokens


@pytest.mark.parametrize("vocab,pre", BPE_FLAVOURS + [("spm", None)])
def test_round_trip(vocab, pre):
    tok = tiny_model("phi3").tokenizer if vocab == "spm" else bpe_model(vocab, pre).tokenizer
    for text in TEXTS + [" leading space", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_spm_falls_back_to_byte_tokens():
    tok = tiny_model("phi3").tokenizer
    ids = tok.encode("€", add_bos=False)
    assert [tok.tokens[i] for i in ids][-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]


def test_special_tokens_in_text_become_their_ids():
    tok = tiny_model("llama").tokenizer
    text = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    ids = tok.encode(text)
    names = [tok.tokens[i] for i in ids]
    assert names[0] == "<|begin_of_text|>" and names[1] == "<|start_header_id|>"
    assert names[-1] == "<|eot_id|>"
    assert tok.decode(ids, special=True) == "<|begin_of_text|>" + text
    assert tok.decode(ids) == "user\n\nhi"   # control tokens are not shown by default


def test_bos_is_added_once():
    tok = tiny_model("llama").tokenizer
    assert tok.encode("hi")[0] == tok.bos_id
    assert tok.encode("<|begin_of_text|>hi").count(tok.bos_id) == 1
    assert tok.bos_id not in tok.encode("hi", add_bos=False)
    chatml = tiny_model("qwen2").tokenizer
    assert not chatml.add_bos and chatml.encode("hi")[0] != chatml.bos_id


def test_end_of_generation_tokens():
    for arch, texts in (("llama", {"<|end_of_text|>", "<|eot_id|>"}),
                        ("qwen2", {"<|endoftext|>", "<|im_end|>"}),
                        ("phi3", {"</s>", "<|end|>", "<|endoftext|>"})):
        tok = tiny_model(arch).tokenizer
        assert {tok.tokens[i] for i in tok.eog_ids} == texts


def test_synth_spm_vocab_ends_with_endoftext():
    # Added last, so no other id moved; llama.cpp refuses a phi3-named file without it.
    tok = tiny_model("phi3").tokenizer
    assert tok.tokens[-1] == "<|endoftext|>" and tok.types[-1] == CONTROL
    assert tok.tokens.count("<|endoftext|>") == 1


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_stream_decoder_emits_only_complete_characters(arch):
    tok = tiny_model(arch).tokenizer
    text = "ℵ€ héllo 日本語 🙂"
    ids = tok.encode(text, add_bos=False)
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "" in pieces[:-1]                          # some character spanned several tokens
    assert all("\ufffd" not in p for p in pieces)     # and none came out broken
    streamed = "".join(pieces)
    assert streamed.lstrip(" ") == text              # SentencePiece keeps the prefix space


def test_stream_decoder_flush_marks_an_unfinished_character():
    tok = tiny_model("phi3").tokenizer
    first_byte = tok.tokens.index("<0xE2>")
    decoder = tok.stream_decoder()
    assert decoder.push(first_byte) == ""
    assert decoder.flush() == "\ufffd"


def test_unsupported_tokenizer_is_a_model_error():
    with pytest.raises(ModelError, match="x.gguf: tokenizer model 'bert' is not supported"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert"}, "x.gguf")
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [],
          "tokenizer.ggml.pre": "klingon"}
    with pytest.raises(ModelError, match="x.gguf: .*pre-tokenizer 'klingon' is not supported"):
        Tokenizer.from_metadata(md, "x.gguf")


# ---------------------------------------------------------------------------------------------------
# chat templates


def test_chat_template_renders_the_models_format():
    model = tiny_model("llama")
    prompt = model.chat_prompt([{"role": "user", "content": " hi "}])
    assert prompt == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert model.tokenizer.encode(prompt).count(model.tokenizer.bos_id) == 1
    without = model.chat_prompt([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert not without.endswith("<|end_header_id|>\n\n")


def test_chat_template_can_refuse_a_conversation():
    model = tiny_model("qwen2")
    with pytest.raises(ChatTemplateError, match="first message must come from the system or the user"):
        model.chat_prompt([{"role": "assistant", "content": "hi"}])


def test_plain_fallback_without_a_template():
    model = tiny_model("llama", chat_template="")
    assert model.chat_template.is_fallback
    assert model.chat_prompt([{"role": "user", "content": "hi"}]) == "User: hi\n\nAssistant:"


def test_template_runs_sandboxed():
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="SecurityError|unsafe"):
        template.render([])


def test_template_that_does_not_compile_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="does not compile"):
        template = ChatTemplate("{% for %}", origin="m.gguf")
    assert template.is_fallback


def test_tojson_does_not_html_escape():
    out = ChatTemplate("{{ messages[0] | tojson }}").render([{"role": "user", "content": "<b>é</b>"}])
    assert '"<b>é</b>"' in out
