"""Chat templates: rendering equals transformers' apply_chat_template; export keeps the template; Session.chat
and `rlxrt generate --chat` end at the end-of-turn token; a model without a template gets a clear error."""
from __future__ import annotations

import hashlib
import json

import pytest

from rlxrt.errors import GenerationError, UsageError

# SmolLM2-Instruct's ChatML template (a default system message when none is given)
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# bos_token, loop controls, tojson with non-ASCII text and raise_exception, as Llama-3-style templates use them
FANCY = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
         "{% endif %}{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
         "[{{ m['role'] | upper }}] {{ m['content'] | trim }} {{ m['content'] | tojson }}{{ eos_token }}\n"
         "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
# a training template: the assistant's text inside {% generation %} blocks (transformers' assistant mask)
MASKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
          "{{ m['content'] }}<|end|>{% endgeneration %}\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [
    [{"role": "user", "content": "Write a function that adds two numbers."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Ünïcödé → 数学 ✓  "},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "skip"},
     {"role": "user", "content": "again"}],
]


def _tokenizer(tmp_path, template):
    from hf_models import make_tokenizer
    from transformers import AutoTokenizer

    make_tokenizer(tmp_path, chat_template=template)
    return AutoTokenizer.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("template", [CHATML, FANCY, MASKED], ids=["chatml", "fancy", "generation-block"])
@pytest.mark.parametrize("messages", MESSAGES, ids=["one", "many"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_equals_transformers(tmp_path, template, messages, generation_prompt):
    pytest.importorskip("transformers")
    from rlxrt.sessions.chat import ChatTemplate

    hf = _tokenizer(tmp_path, template)
    (tmp_path / "t.jinja").write_text(template)
    ours = ChatTemplate(tmp_path, {"template": "t.jinja", "bos_token": hf.bos_token, "eos_token": hf.eos_token})
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.render(messages, add_generation_prompt=generation_prompt) == want


def test_template_errors_are_typed(tmp_path):
    from rlxrt.errors import ModelFormatError
    from rlxrt.sessions.chat import ChatTemplate

    (tmp_path / "t.jinja").write_text(FANCY)
    t = ChatTemplate(tmp_path, {"template": "t.jinja"})
    with pytest.raises(GenerationError, match="no tools"):
        t.render([{"role": "tool", "content": "x"}])
    for bad, words in [("hi", "list of"), ([], "empty"), ([{"content": "x"}], "messages[0]['role']"),
                       ([{"role": "user", "content": 3}], "messages[0]['content'] must be text"),
                       ([{"role": "user", "content": "a"}, "b"], "messages[1] must be a dict")]:
        with pytest.raises(GenerationError, match=words.replace("[", r"\[").replace("]", r"\]")):
            t.render(bad)
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(ModelFormatError, match="does not parse"):
        ChatTemplate(tmp_path, {"template": "bad.jinja"})
    with pytest.raises(ModelFormatError, match="missing.jinja"):
        ChatTemplate(tmp_path, {"template": "missing.jinja"})


@pytest.mark.export
def test_export_keeps_template_and_chat_ends_at_end_of_turn(exported, tmp_path):
    from transformers import AutoTokenizer

    from rlxrt.sessions import PromptLookup, Session

    model = exported("llama", seed=3, chat_template=CHATML)
    manifest = json.loads((model / "rlxrt.json").read_text())
    hf = AutoTokenizer.from_pretrained(str(model))
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert manifest["chat"] == {"template": "chat_template.jinja", "bos_token": "<s>", "eos_token": "<|im_end|>",
                                "end_of_turn_ids": [1, im_end]}
    assert (model / "chat_template.jinja").read_text() == CHATML

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    plain = Session(model)
    want_ids = hf.apply_chat_template(messages, add_generation_prompt=True)
    assert plain.chat_prompt(messages) == list(want_ids)
    g = plain.chat(messages, max_new_tokens=40, ignore_eos=False)
    # the same request as ids with the end-of-turn ids as stop tokens
    ref = plain.generate(list(want_ids), max_new_tokens=40, stop_token_ids=[im_end])
    assert (g.text, g.token_ids, g.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)
    spec = Session(model, PromptLookup()).chat(messages, max_new_tokens=40)
    assert spec.token_ids == g.token_ids
    # a forced end-of-turn: every reply that emits <|im_end|> ends there
    forced = plain.chat(messages, max_new_tokens=40, temperature=1.0, seed=1)
    assert im_end not in forced.token_ids[:-1] and 1 not in forced.token_ids[:-1]
    with pytest.raises(GenerationError, match="stop_token_ids"):
        plain.chat(messages, stop_token_ids=5)
    with pytest.raises(GenerationError, match="messages is empty"):
        plain.chat([])
    assert plain.chat(messages, max_new_tokens=3).token_ids  # the session still serves


@pytest.mark.export
def test_generate_chat_cli(exported, capsys):
    from rlxrt.app.cli import main
    from rlxrt.sessions import Session

    model = exported("llama", seed=3, chat_template=CHATML)
    rc = main(["generate", "--target", str(model), "--prompt", "def add(a, b):", "--system", "Be brief.",
               "--max-new-tokens", "20", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    want = Session(model).chat([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "def add(a, b):"}], max_new_tokens=20)
    assert out["token_ids"] == want.token_ids and out["text"] == want.text


def test_no_template_is_a_clear_error(capsys):
    from rlxrt.app.cli import main
    from rlxrt.app.reference import reference_pair
    from rlxrt.sessions import Session

    target, _ = reference_pair()
    s = Session(target)
    assert not s.has_chat_template
    with pytest.raises(GenerationError, match="no chat template.*plain prompt"):
        s.chat([{"role": "user", "content": "hi"}])
    assert s.generate("def f(", max_new_tokens=2).token_ids  # still usable
    rc = main(["generate", "--target", str(target), "--prompt", "hi", "--chat"])
    err = capsys.readouterr().err
    assert rc == 2 and "no chat template" in err and "drop --chat" in err


@pytest.mark.export
def test_distill_writes_the_targets_own_dialogues_and_continues(exported, tmp_path, capsys):
    """`rlxrt distill`: each document is the rendered user turn plus the target's reply (greedy and seeded
    sampled, as Session.chat gives them), the end-of-turn token when the reply ended with it; a second run
    continues after the documents already written; a refused run leaves the corpus alone."""
    from rlxrt.app.cli import main
    from rlxrt.sessions import PromptLookup, Session

    model = exported("llama", seed=3, chat_template=CHATML)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\nWrite a loop.\nclass Stack:\n")
    out = tmp_path / "corpus.json"
    args = ["distill", str(model), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "24",
            "--temperatures", "0,0.9", "--seed", "5", "--threads", "1", "--quiet"]
    assert main([*args, "--limit", "2"]) == 0
    assert len(json.loads(out.read_text())) == 2
    assert main(args) == 0
    docs = json.loads(out.read_text())
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["documents"] == 3 and summary["chat_template"] is True
    s = Session(model, PromptLookup())  # the speculator distill decodes with: the same seeded draws
    for i, (prompt, temp) in enumerate([("def add(a, b):", 0.0), ("Write a loop.", 0.9), ("class Stack:", 0.0)]):
        messages = [{"role": "user", "content": prompt}]
        g = s.chat(messages, max_new_tokens=24, temperature=temp, seed=5 + i)
        end = "<|im_end|>" if g.finish_reason == "stop" else ""
        assert docs[i] == s.chat_text(messages) + g.text + end
        if temp == 0:  # greedy replies are plain decoding's own
            assert g.token_ids == Session(model).chat(messages, max_new_tokens=24).token_ids
    assert main([*args, "--temperatures", "-1"]) == 1
    assert "--temperatures must lie in 0..10" in capsys.readouterr().err
    assert json.loads(out.read_text()) == docs  # a refused run leaves the corpus alone


class _Scripted:
    """A stand-in session for self_prompts' selection rule: scripted replies, the calls recorded."""
    has_chat_template = True

    def __init__(self, replies):
        from types import SimpleNamespace

        self.replies, self.calls = list(replies), []
        self.codec = SimpleNamespace(encode=lambda text, add_special_tokens=True: (text, add_special_tokens))

    def chat_text(self, messages):
        return "<u>" + messages[0]["content"] + "</u><a>"

    def generate(self, text, **kw):
        self.calls.append((text, kw))
        return self.replies.pop(0)


def _reply(text, finish="stop", stop_reason=7):
    from types import SimpleNamespace

    return SimpleNamespace(text=text, finish_reason=finish, stop_reason=stop_reason)


def test_self_prompts_keep_finished_new_requests(monkeypatch):
    """A self-written request is kept when the target ended its turn with an end token (not the length, not a
    stop string), it has three words or more and it is new; each try starts from the template's empty user
    turn plus the next opener, with its own seed; at most TRIES samples per requested prompt."""
    from rlxrt.app import distill

    s = _Scripted([_reply(" a joke, please"), _reply(" that adds two numbers"), _reply(" recursion"),
                   _reply(" cook rice well", finish="length", stop_reason=None),
                   _reply(" a monad, really", stop_reason="###"), _reply(" help me move")])
    assert distill.self_prompts(s, 3, seed=40) == ["a joke, please", "Write a Python function that adds two numbers",
                                                   "Can you help me move"]
    # encoded without the tokenizer's own BOS: the rendered template carries whatever it needs
    assert [c[0] for c in s.calls] == [("<u>" + o, False) for o in distill.OPENERS[:6]]
    assert [c[1]["seed"] for c in s.calls] == [40, 41, 42, 43, 44, 45]
    assert all(c[1]["temperature"] == 0.7 and c[1]["top_p"] == 0.9 for c in s.calls)

    monkeypatch.setattr(distill, "OPENERS", ("",))
    s = _Scripted([_reply("tell me more"), _reply(" tell me more ")] + [_reply("no")] * 10)
    assert distill.self_prompts(s, 3) == ["tell me more"]  # the duplicate and the short ones are dropped
    assert len(s.calls) == 3 * distill.TRIES

    # excluded prompts (e.g. the evaluation's) are dropped, equal or holding 80 % of their words
    s = _Scripted([_reply("Explain what a hash table is."), _reply("explain what a hash table is, briefly"),
                   _reply("Explain what a hash map is."), _reply("Explain how a compiler works."),
                   _reply("Write a haiku about rain")])  # (5 of the 6 words of the first: dropped too)
    assert distill.self_prompts(s, 2, exclude=["Explain what a hash table is.", "Tell me a joke"]) == [
        "Explain how a compiler works.", "Write a haiku about rain"]

    # a run stopped after some tries continues from them: the same requests as an uninterrupted run
    seen = []
    s = _Scripted([_reply(" a joke, please"), _reply(" sort a list")])
    assert distill.self_prompts(s, 2, seed=5, start=(["a joke, please"], 2),
                                progress=lambda kept, tries: seen.append((list(kept), tries))) == [
        "a joke, please", "sort a list"]  # the repeat is still dropped; seeds go on from try 2
    assert [c[1]["seed"] for c in s.calls] == [7, 8]
    assert seen == [(["a joke, please"], 3), (["a joke, please", "sort a list"], 4)]

    s.has_chat_template = False
    with pytest.raises(UsageError, match="--self-prompts needs a model with a chat template.*--prompts FILE"):
        distill.self_prompts(s, 1)


@pytest.mark.export
def test_distill_self_prompts_end_to_end(exported, tmp_path, capsys):
    """`rlxrt distill --self-prompts N`: the target writes the requests (kept in OUT-prompts.json, the ones
    self_prompts gives for the seed), replies to each, and a continued run reuses the file it wrote."""
    from rlxrt.app.cli import main
    from rlxrt.app.distill import self_prompts
    from rlxrt.sessions import PromptLookup, Session

    model = exported("llama", seed=3, chat_template=CHATML)
    out = tmp_path / "self.json"
    args = ["distill", str(model), "--self-prompts", "2", "--out", str(out), "--max-new-tokens", "12",
            "--seed", "9", "--threads", "1", "--quiet"]
    assert main([*args, "--limit", "1"]) == 0
    written = tmp_path / "self-prompts.json"
    s = Session(model, PromptLookup())
    assert json.loads(written.read_text()) == self_prompts(s, 2, seed=9)
    assert len(json.loads(out.read_text())) == 1
    written.write_text(json.dumps(["alpha beta gamma", "delta epsilon zeta"]))
    assert main(args) == 0
    docs = json.loads(out.read_text())
    assert len(docs) == 2 and docs[1].startswith(s.chat_text([{"role": "user", "content": "delta epsilon zeta"}]))
    # a run stopped while writing its requests continues from OUT-prompts.partial.json, then removes it
    again = [*args[:5], str(tmp_path / "again.json"), *args[6:]]
    partial, requests = tmp_path / "again-prompts.partial.json", tmp_path / "again-prompts.json"
    run = {"self_prompts": 2, "seed": 9, "exclude_sha256": hashlib.sha256(b"[]").hexdigest()}
    partial.write_text(json.dumps({**run, "tries": 1, "kept": ["alpha beta gamma"]}))
    assert main([*again, "--limit", "0"]) == 0
    assert json.loads(requests.read_text()) == self_prompts(s, 2, seed=9, start=(["alpha beta gamma"], 1))
    assert not partial.exists()
    requests.unlink()
    capsys.readouterr()
    for saved, message, code in (({**run, "seed": 10, "tries": 1, "kept": []}, "other --self-prompts, --seed or --exclude",
                                  2), ({**run, "tries": "1", "kept": []}, "is damaged", 1)):
        partial.write_text(json.dumps(saved))
        assert main(again) == code
        assert message in capsys.readouterr().err and partial.exists() and not requests.exists()
    assert main(["distill", str(model), "--out", str(tmp_path / "x.json")]) == 2
    assert "distill needs --prompts FILE or --self-prompts N" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    assert main([*args[:-1], "--out", str(tmp_path / "y.json"), "--exclude", str(tmp_path / "bad.json")]) == 1
    assert "--exclude" in capsys.readouterr().err and not (tmp_path / "y-prompts.json").exists()
    assert main(["distill", str(model), "--prompts", str(written), "--out", str(tmp_path / "z.json"),
                 "--exclude", str(written)]) == 2
    assert "pass --self-prompts N too" in capsys.readouterr().err
