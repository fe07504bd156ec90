"""Tokenizer, SFT file reading, row building (packing/padding) and the resumable batch iterator."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from mcore_rl.config.schema import DataConfig, ModelConfig
from mcore_rl.data.sft import (
    DataError,
    SFTBatches,
    SFTExample,
    build_rows,
    build_sft_rows,
    read_examples,
    tokenize_example,
)
from mcore_rl.data.tasks.addition import DEFAULT_MAX_DIGITS, make_addition_examples, verify_addition
from mcore_rl.data.tokenizer import BUNDLED_DIR, TOKENIZER_FILE, ByteTokenizer, load_tokenizer

TOK = load_tokenizer(None)


# ------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text", ["", "hello world", "naïve café — 日本語 🙂🚀", "a\tb\n\x00\x7f", "e\u0301 <|reserved_3|>"]
)
def test_byte_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


def test_special_tokens():
    assert TOK.vocab_size == ModelConfig().vocab_size == 384
    assert len({TOK.pad_id, TOK.bos_id, TOK.eos_id}) == 3 and min(TOK.pad_id, TOK.bos_id, TOK.eos_id) >= 256
    ids = TOK.encode("<|im_start|>hi<eos>")
    assert ids[0] == TOK.token_to_id("<|im_start|>") and ids[-1] == TOK.eos_id and len(ids) == 4
    assert TOK.decode(ids) == "<|im_start|>hi<eos>"
    assert TOK.decode(ids, skip_special_tokens=True) == "hi"
    # a multi-byte character is not split around a special token
    assert TOK.decode(list("é".encode()) + [TOK.eos_id]) == "é<eos>"


def test_bundled_file_matches_default_and_dir_loading(tmp_path):
    bundled = json.load(open(os.path.join(BUNDLED_DIR, TOKENIZER_FILE)))
    ByteTokenizer.default().save(str(tmp_path))
    assert json.load(open(tmp_path / TOKENIZER_FILE)) == bundled
    assert load_tokenizer(str(tmp_path)).encode("xyz") == TOK.encode("xyz")
    assert load_tokenizer(str(tmp_path / TOKENIZER_FILE)).vocab_size == 384


def test_missing_tokenizer_path(tmp_path):
    missing = str(tmp_path / "no_such_tokenizer")
    with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
        load_tokenizer(missing)


def test_local_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3, "hello": 4, "world": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([4, 5]) == "hello world"
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (6, 1, 2, 3)


# ------------------------------------------------------------------- reading files


def write_bytes(tmp_path, name, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


BAD_JSONL = b"\n".join(
    [
        b'{"prompt": "1+1=", "response": "2"}',  # 1 ok
        b'{"prompt": "1+1=", "response": ',  # 2 bad JSON
        b"",  # 3 blank: ignored
        b'{"question": "x"}',  # 4 missing keys
        b'{"prompt": "a", "response": 3}',  # 5 wrong type
        b"[1, 2]",  # 6 not an object
        b'{"text": "\xff\xfe"}',  # 7 bad UTF-8
        b'{"text": "a whole document"}',  # 8 ok
        b'{"prompt": "p"}',  # 9 missing response
    ]
)


def test_bad_lines_skip(tmp_path, caplog):
    path = write_bytes(tmp_path, "d.jsonl", BAD_JSONL)
    with caplog.at_level(logging.WARNING):
        exs = read_examples(DataConfig(path=path, on_bad_line="skip"))
    assert [(e.prompt, e.response) for e in exs] == [("1+1=", "2"), ("", "a whole document")]
    assert exs[1].source == f"{path}:8"
    for lineno in (2, 4, 5, 6, 7, 9):
        assert f"{path}:{lineno}:" in caplog.text
    assert f"{path}:3:" not in caplog.text


@pytest.mark.parametrize(
    "lineno, problem",
    [
        (2, "invalid JSON"),
        (4, "missing keys"),
        (5, "expected strings"),
        (6, "JSON object"),
        (7, "UTF-8"),
        (9, "missing key"),
    ],
)
def test_bad_lines_error_names_file_and_line(tmp_path, lineno, problem):
    lines = BAD_JSONL.split(b"\n")
    # one good line, blank lines, then the bad line at `lineno`
    path = write_bytes(tmp_path, "d.jsonl", b"\n".join(lines[:1] + [b""] * (lineno - 2) + [lines[lineno - 1]]))
    with pytest.raises(DataError) as e:
        read_examples(DataConfig(path=path, on_bad_line="error"))
    assert f"{path}:{lineno}:" in str(e.value) and problem in str(e.value)


def test_custom_keys_and_text_format(tmp_path):
    path = write_bytes(tmp_path, "d.jsonl", b'{"q": "a", "a": "b"}\n')
    exs = read_examples(DataConfig(path=path, prompt_key="q", response_key="a"))
    assert (exs[0].prompt, exs[0].response) == ("a", "b")
    path = write_bytes(tmp_path, "d.txt", b"first doc\nstill first\n\n\n second doc\n")
    exs = read_examples(DataConfig(path=path))
    assert [e.response for e in exs] == ["first doc\nstill first", " second doc"]
    assert [e.source for e in exs] == [f"{path}:1", f"{path}:5"]


def test_missing_and_empty_data_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="nope.jsonl"):
        read_examples(DataConfig(path=missing))
    empty = write_bytes(tmp_path, "e.jsonl", b"\n\n")
    with pytest.raises(DataError, match="no usable examples"):
        read_examples(DataConfig(path=empty))


# ------------------------------------------------------------------- RL prompt files

PROMPTS = b"\n".join(
    [
        b'{"prompt": "1+1=", "label": "2"}',  # 1 ok
        b'{"prompt": "caf\xe9"}',  # 2 latin-1, not UTF-8
        b'{"prompt": 3}',  # 3 not a string
        b'{"prompt": "2+2="',  # 4 bad JSON
        b'{"prompt": "3+3=", "label": "6"}',  # 5 ok
    ]
)


@pytest.mark.parametrize("lineno, problem", [(2, "not valid UTF-8"), (3, "string 'prompt'"), (4, "invalid JSON")])
def test_prompt_file_bad_line_names_file_and_line(tmp_path, lineno, problem):
    from mcore_rl.data.prompts import read_prompt_file

    lines = PROMPTS.split(b"\n")
    path = write_bytes(tmp_path, "p.jsonl", b"\n".join(lines[:1] + [b""] * (lineno - 2) + [lines[lineno - 1]]))
    with pytest.raises(DataError) as e:
        read_prompt_file(path, "prompt", "label")
    assert str(e.value).startswith(f"{path}:{lineno}: ") and problem in str(e.value)
    assert "data.on_bad_line=skip" in str(e.value)


def test_prompt_file_skip_and_missing(tmp_path, caplog):
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.data.prompts import read_prompt_file, read_prompt_files

    path = write_bytes(tmp_path, "p.jsonl", PROMPTS)
    with caplog.at_level(logging.WARNING):
        assert read_prompt_file(path, "prompt", "label", on_bad_line="skip") == [("1+1=", "2"), ("3+3=", "6")]
    assert all(f"{path}:{n}:" in caplog.text for n in (2, 3, 4))
    cfg = load_config(RLConfig, None, [f"data.path={path}", "data.on_bad_line=skip", f"eval.path={tmp_path}/no.jsonl"])
    with pytest.raises(DataError, match=f"eval.path: no such file: {tmp_path}/no.jsonl"):
        read_prompt_files(cfg)
    cfg.eval.path = None
    assert read_prompt_files(cfg) == {"data.path": [("1+1=", "2"), ("3+3=", "6")]}
    with pytest.raises(DataError, match=r"no prompts \(1 bad line\(s\) skipped\)"):
        read_prompt_file(write_bytes(tmp_path, "q.jsonl", b"\xff\n"), "prompt", "label", on_bad_line="skip")


def docs_of(rows, r):
    """Split row r into documents by segment id (ignoring padding)."""
    seg = rows["segment_ids"][r]
    return [int(s) for s in seg.unique() if s > 0]


def test_tokenize_masks_prompt():
    ids, target = tokenize_example(SFTExample("ab", "cd", "t"), TOK, mask_prompt=True)
    assert ids == [TOK.bos_id, 97, 98, 99, 100, TOK.eos_id]
    assert target == [0, 0, 0, 1, 1, 1]
    _, target = tokenize_example(SFTExample("ab", "cd", "t"), TOK, mask_prompt=False)
    assert target == [0, 1, 1, 1, 1, 1]


def test_packing_invariants():
    exs = [SFTExample(p["prompt"], p["response"], "s") for p in make_addition_examples(40, seed=0, max_digits=3)]
    exs.append(SFTExample("x" * 5, "y" * 100, "long"))  # longer than a row: truncated
    samples = [tokenize_example(e, TOK, mask_prompt=True) for e in exs]
    s = 48
    rows = build_rows(samples, s, pack=True, pad_id=TOK.pad_id)
    assert all(v.shape == (rows["tokens"].shape[0], s) for v in rows.values())
    assert rows["loss_mask"].dtype == torch.float32
    assert rows["tokens"].shape[0] < len(exs) / 2  # several examples per row
    # labels are the next token
    assert torch.equal(rows["labels"][:, :-1], rows["tokens"][:, 1:])
    n_trained = 0
    for r in range(rows["tokens"].shape[0]):
        tok, lab, mask = rows["tokens"][r], rows["labels"][r], rows["loss_mask"][r]
        pos, seg = rows["position_ids"][r], rows["segment_ids"][r]
        for d in docs_of(rows, r):
            idx = (seg == d).nonzero().flatten()
            assert torch.equal(idx, torch.arange(idx[0], idx[-1] + 1))  # contiguous
            assert torch.equal(pos[idx], torch.arange(len(idx)))  # positions restart
            assert tok[idx[0]] == TOK.bos_id
            # the label after a doc's last token belongs to the next doc or padding, so it is masked;
            # only a doc running into the row's extra (s+1-th) token keeps its own last label
            assert mask[idx[-1]] == 0 or (idx[-1] == s - 1 and lab[idx[-1]] != TOK.pad_id)
            trained = idx[mask[idx] > 0]
            text = TOK.decode(lab[trained].tolist())
            n_trained += 1
            if text.startswith("y"):
                assert set(text) == {"y"}  # truncated long example: only response bytes, no eos
            else:
                assert text.endswith("<eos>") and "=" not in text and "+" not in text  # response + eos only
                prompt = TOK.decode(tok[idx[1] : idx[-1]].tolist()).split("=")[0] + "="
                assert verify_addition(prompt, text[: -len("<eos>")]) == 1.0
        pad = seg == 0
        assert (mask[pad] == 0).all() and (tok[pad] == TOK.pad_id).all()
    assert n_trained == len(exs)


def test_padding_mode():
    samples = [tokenize_example(SFTExample("ab", "c" * k, "t"), TOK, mask_prompt=True) for k in (1, 5, 30)]
    rows = build_rows(samples, 16, pack=False, pad_id=TOK.pad_id)
    assert rows["tokens"].shape == (3, 16)
    assert torch.equal(rows["segment_ids"][0], torch.tensor([1] * 5 + [0] * 11))
    assert rows["loss_mask"][0].tolist() == [0, 0, 1, 1] + [0] * 12  # labels c, eos
    assert (rows["tokens"][0, 5:] == TOK.pad_id).all() and (rows["labels"][0, 4:] == TOK.pad_id).all()
    assert rows["loss_mask"][2].sum() == 14  # truncated to 17 tokens: 14 response labels, no eos


def test_build_sft_rows_synthetic_and_file(tmp_path):
    rows = build_sft_rows(DataConfig(synthetic_num_examples=50), 64, TOK, seed=1)
    assert rows["tokens"].shape[1] == 64
    assert rows["loss_mask"].sum() == 50 * (DEFAULT_MAX_DIGITS + 2)  # the sum's digits + eos
    path = write_bytes(tmp_path, "d.jsonl", b'{"prompt": "q", "response": "r"}\n' * 3)
    rows = build_sft_rows(DataConfig(path=path, pack_sequences=False, mask_prompt=False), 8, TOK, seed=1)
    assert rows["tokens"].shape == (3, 8) and rows["loss_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


# ------------------------------------------------------------------- batches


def toy_rows(n=23, s=4):
    ids = torch.arange(n)[:, None].expand(n, s).contiguous()
    return {
        "tokens": ids,
        "labels": ids.clone(),
        "loss_mask": torch.ones(n, s),
        "position_ids": torch.zeros(n, s, dtype=torch.long),
        "segment_ids": torch.ones(n, s, dtype=torch.long),
    }


def row_ids(step):
    return [int(x) for mb in step for x in mb["tokens"][:, 0]]


def test_batches_shapes_and_epochs():
    it = SFTBatches(toy_rows(), micro_batch_size=2, num_microbatches=3, dp_rank=0, dp_size=1, seed=5)
    assert it.steps_per_epoch == 3
    step = next(it)
    assert len(step) == 3 and step[0]["tokens"].shape == (2, 4) and set(step[0]) == set(toy_rows())
    epoch0 = row_ids(step) + row_ids(next(it)) + row_ids(next(it))
    assert len(set(epoch0)) == 18  # no repeats within an epoch; 5 rows dropped
    epoch1 = row_ids(next(it)) + row_ids(next(it)) + row_ids(next(it))
    assert it.epoch == 1 and epoch1 != epoch0  # reshuffled


def test_dp_ranks_disjoint_and_cover_the_global_batch():
    rows = toy_rows(40)
    its = [SFTBatches(rows, 2, 2, r, 3, seed=0) for r in range(3)]
    single = SFTBatches(rows, 2, 2 * 3, 0, 1, seed=0)  # same global batch on one rank
    for _ in range(5):  # crosses an epoch boundary (3 steps per epoch)
        per_rank = [set(row_ids(next(it))) for it in its]
        assert all(len(s) == 4 for s in per_rank)
        assert not (per_rank[0] & per_rank[1]) and not (per_rank[0] & per_rank[2]) and not (per_rank[1] & per_rank[2])
        assert set().union(*per_rank) == set(row_ids(next(single)))


def test_resume_equals_uninterrupted():
    rows = toy_rows(23)
    ref = SFTBatches(rows, 2, 2, 1, 2, seed=9)
    expected = [row_ids(next(ref)) for _ in range(8)]
    first = SFTBatches(rows, 2, 2, 1, 2, seed=9)
    got = [row_ids(next(first)) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint
    resumed = SFTBatches(rows, 2, 2, 1, 2, seed=9)
    resumed.load_state_dict(state)
    got += [row_ids(next(resumed)) for _ in range(4)]
    assert got == expected
    with pytest.raises(ValueError, match="seed"):
        SFTBatches(rows, 2, 2, 1, 2, seed=10).load_state_dict(state)


def test_too_little_data():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        SFTBatches(toy_rows(5), 2, 2, 0, 2, seed=0)


# ------------------------------------------------------------------- synthetic task


def test_addition_examples_and_verifier():
    exs = make_addition_examples(100, seed=3, max_digits=3)
    assert exs == make_addition_examples(100, seed=3, max_digits=3)
    for e in exs:
        assert len(e["prompt"]) == 8 and len(e["response"]) == 4
        assert verify_addition(e["prompt"], e["response"]) == 1.0
        assert verify_addition(e["prompt"], " " + e["response"] + "\n") == 1.0
    assert make_addition_examples(1, seed=0, max_digits=2)[0]["prompt"].count("+") == 1
    assert verify_addition("012+345=", "7530") == 1.0 and verify_addition("012+345=", "753") == 1.0
    assert verify_addition("012+345=", "357") == 0.0
    assert verify_addition("012+345=", "7a5") == 0.0 and verify_addition("012+345=", "") == 0.0
    with pytest.raises(ValueError):
        verify_addition("hello", "1")
