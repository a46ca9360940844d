"""Does pebbling's server render a chat as llama.cpp renders the file's own template? Token for token.

    python benchmarks/agreement.py chat [--json FILE]

For a synthetic gpt-oss file with a harmony template (pyplugin.model.synth_vocab's, written short after
gpt-oss's), a Qwen3 file (its thinking template) and a Gemma 4 file (its turns, thought channel and calls), a few conversations go through pebbling's engine as a
client sends them on each API: Ollama's /api/chat body (messages, tools, `think` with its levels) and OpenAI's
/v1/chat/completions body (calls with JSON-string arguments and ids, results by tool_call_id, thinking as
reasoning_content, the level as reasoning_effort), each turned into the engine's request by the route's own
conversion (server_patch); the prompt the engine evaluates is read back from the response's context. The same conversation, in the shape chat templates take (Hugging Face's:
calls in tool_calls with their arguments as objects, results under role "tool" with the function's name,
thinking beside them), is rendered by llama-cpp-python's Jinja2ChatFormatter from the template in the file's
metadata, with the reasoning effort where given, and tokenized by llama.cpp (special tokens as tokens). The two
token lists must be equal. Exit status: 0 when every conversation agrees, 1 when one does not, 2 without
llama-cpp-python.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from pyplugin.model.synth import write_gguf
from pyplugin.serving import Engine, Final, GenerationRequest
from server_patch.openai_compat import _text_content
from server_patch.replies import chat_message, openai_messages, openai_tools
from server_patch.schemas import ChatCompletionRequest, ChatRequest

from .agreement_llamacpp import in_llama_process

ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
QUESTION = {"role": "user", "content": "What is 2 + 2?"}
# (name, the client's messages on Ollama's API, the template's messages, tools, think)
CALL = {"function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
CONVERSATIONS = [
    ("question", [QUESTION], [QUESTION], None, None),
    ("think low", [QUESTION], [QUESTION], None, "low"),
    ("think high, system", [{"role": "system", "content": "Be brief."}, QUESTION],
     [{"role": "system", "content": "Be brief."}, QUESTION], None, "high"),
    ("tools", [QUESTION], [QUESTION], [ADD], None),
    ("a call and its result",
     [QUESTION, {"role": "assistant", "content": "", "thinking": "I should add.", "tool_calls": [CALL]},
      {"role": "tool", "content": "4", "tool_name": "add"}],
     [QUESTION, {"role": "assistant", "content": "", "thinking": "I should add.", "reasoning_content": "I should add.",
                 "tool_calls": [{"type": "function", **CALL}]},
      {"role": "tool", "content": "4", "name": "add", "tool_name": "add"}], [ADD], "medium"),
    ("an answer after the call",
     [QUESTION, {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "content": "4", "tool_name": "add"}, {"role": "assistant", "content": "It is 4."},
      {"role": "user", "content": "Thanks."}],
     [QUESTION, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", **CALL}]},
      {"role": "tool", "content": "4", "name": "add", "tool_name": "add"}, {"role": "assistant", "content": "It is 4."},
      {"role": "user", "content": "Thanks."}], [ADD], None),
    # think on/off where a template reads enable_thinking (Qwen3's, Gemma 4's; harmony's levels above)
    ("think on", [QUESTION], [QUESTION], None, True),
    ("think off, a call and its result",
     [QUESTION, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "4", "tool_name": "add"}],
     [QUESTION, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", **CALL}]},
      {"role": "tool", "content": "4", "name": "add", "tool_name": "add"}], [ADD], False),
]
FILES = {"gpt-oss": dict(arch="gpt-oss", vocab="harmony", n_expert=4, n_expert_used=2, key_length=16, n_ff_exp=32,
                         sliding_window=8),
         "qwen3": dict(arch="qwen3", vocab="qwen3"),
         # Gemma 4's turns, thought channel and calls (synth_vocab's template, written after Gemma 4's): a sliding
         # layer and a full one, as llama.cpp needs one of each
         "gemma4": dict(arch="gemma4", vocab="gemma4", n_layer=2, key_length=32, sliding_window=8,
                        swa_pattern=[True, False], gemma4={"head_dim_swa": 16})}


def as_openai(messages: list[dict]) -> list[dict]:
    """A conversation of Ollama's shape in OpenAI's: calls with ids and JSON-string arguments, results answering
    them by id, thinking as reasoning_content."""
    out, ids = [], []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                ids.append(f"call_{len(ids)}")
                calls.append({"id": ids[-1], "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}})
            m["tool_calls"] = calls
            m["content"] = m.get("content") or None
        if "thinking" in m:
            m["reasoning_content"] = m.pop("thinking")
        if m["role"] == "tool":
            m = {"role": "tool", "content": m["content"], "tool_call_id": ids[len([x for x in out if x["role"] == "tool"])]}
        out.append(m)
    return out


def route_request(route: str, model: str, messages: list[dict], tools, think) -> GenerationRequest:
    """The engine's request as the route makes it from a client's body (server_patch's own conversions)."""
    if route == "ollama":
        body = ChatRequest(model=model, messages=messages, tools=tools, think=think)
        return GenerationRequest(model=model, messages=[chat_message(m, i) for i, m in enumerate(body.messages)],
                                 tools=body.tools or None, think=body.think)
    level = think if isinstance(think, str) else None
    body = ChatCompletionRequest(model=model, messages=as_openai(messages), tools=tools, reasoning_effort=level,
                                 **({"think": think} if think is not None and level is None else {}))
    tools_in, choice, think_in = openai_tools(body)
    return GenerationRequest(model=model, messages=openai_messages(body, _text_content), tools=tools_in,
                             tool_choice=choice, think=think_in)


def pebbling_prompt(models: Path, request: GenerationRequest) -> list[int]:
    """The prompt the server evaluates for this request: its context less the one token it generated."""
    engine = Engine(models)
    try:
        request.options = {"num_predict": 1, "temperature": 0}
        job = engine.submit(request)
        final = next(item for item in job if isinstance(item, Final))
        return list(final.context[:len(final.context) - final.eval_count])
    finally:
        engine.close()


def _render_job(llm, conversations: list[tuple[list[dict], Any, Any]]) -> list[list[int]]:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: PLC0415 - optional
    md = llm.metadata
    bos = llm._model.token_get_text(llm.token_bos()) if llm.token_bos() >= 0 else ""
    eos = llm._model.token_get_text(llm.token_eos()) if llm.token_eos() >= 0 else ""
    formatter = Jinja2ChatFormatter(md["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
    out = []
    for messages, tools, think in conversations:
        extra = {"reasoning_effort": think} if isinstance(think, str) else {}
        if think is not None and not isinstance(think, str):
            extra["enable_thinking"] = bool(think)
        prompt = formatter(messages=messages, tools=tools, **extra).prompt
        out.append(llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp)
        for name, spec in FILES.items():
            write_gguf(models / f"{name}.gguf", **{"n_layer": 1, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 64,
                                                   "n_ctx": 1024, **spec})
            cases = [c for c in CONVERSATIONS if not isinstance(c[4], bool if name == "gpt-oss" else str)]
            refs = in_llama_process(_render_job, models / f"{name}.gguf", [(c[2], c[3], c[4]) for c in cases])
            for (label, client, _, tools, think), ref in zip(cases, refs):
                for route in ("ollama", "openai"):
                    got = pebbling_prompt(models, route_request(route, name, client, tools, think))
                    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
                    if first is None and len(got) != len(ref):
                        first = min(len(got), len(ref))
                    rows.append({"model": name, "conversation": label, "route": route, "tokens": len(ref),
                                 "equal": got == ref, "first_difference": first})
    print(f"{'model':8} {'conversation':26} {'route':7} {'tokens':>6}  equal")
    for r in rows:
        where = "" if r["equal"] else f"  first difference at token {r['first_difference']}"
        print(f"{r['model']:8} {r['conversation']:26} {r['route']:7} {r['tokens']:6}  {'yes' if r['equal'] else 'NO'}"
              f"{where}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = sum(not r["equal"] for r in rows)
    print(f"\n{len(rows) - bad} conversations rendered alike, {bad} apart")
    return 1 if bad else 0
