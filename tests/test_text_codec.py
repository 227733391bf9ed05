"""A model's tokenizer is read once and shared by its Sessions, and read again (through the directory's box) when
its file changes."""
import os
import shutil

import pytest

from rlxrt import Config
from rlxrt.app.reference import reference_pair
from rlxrt.backends import compile
from rlxrt.errors import ModelFormatError
from rlxrt.sessions import DraftModel, Session
from rlxrt.sessions.text import TextCodec

CFG = Config(intra_op_threads=1, cache=False)
PROMPT = "def add(a, b):\n"


@pytest.fixture
def target(tmp_path):
    d = tmp_path / "target"
    shutil.copytree(reference_pair()[0], d)
    return d


def test_sessions_of_a_model_share_its_codec_and_decode_the_same(target):
    graph = compile(target, CFG)
    a, b = Session(graph, None, CFG), Session(graph, None, CFG)
    assert a.codec is b.codec
    assert Session(target, None, CFG).codec is a.codec  # compiled again from the same directory
    ga, gb = (s.generate(PROMPT, max_new_tokens=12, ignore_eos=True) for s in (a, b))
    assert ga.token_ids == gb.token_ids and ga.text == gb.text == a.codec.decode(ga.token_ids)


def test_a_rewritten_tokenizer_is_read_again(target):
    graph = compile(target, CFG)
    first = Session(graph, None, CFG).codec
    path = target / "tokenizer.json"
    path.write_text(path.read_text())  # the same text, a new file time
    os.utime(path, ns=(1, 1))
    again = Session(graph, None, CFG).codec
    assert again is not first and again.vocab() == first.vocab()


def test_a_tokenizer_swapped_for_a_link_out_of_the_directory_is_refused(target, tmp_path):
    graph = compile(target, CFG)
    Session(graph, None, CFG)
    outside = tmp_path / "outside.json"
    shutil.copy(target / "tokenizer.json", outside)
    (target / "tokenizer.json").unlink()
    os.symlink(outside, target / "tokenizer.json")
    with pytest.raises(ModelFormatError, match="outside the directory"):
        Session(graph, None, CFG)


def test_a_draft_with_the_same_tokenizer_file_binds_without_comparing_vocabularies(target, monkeypatch):
    graph = compile(target, CFG)
    plain = Session(graph, None, CFG)
    expected = plain.generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids
    with monkeypatch.context() as m:
        m.setattr(TextCodec, "vocab", lambda self: pytest.fail("compared a codec's vocabulary with itself"))
        s = Session(graph, DraftModel(graph, CFG), CFG, k=2)  # the target as its own draft: one codec
    assert s.generate(PROMPT, max_new_tokens=12, ignore_eos=True).token_ids == expected
